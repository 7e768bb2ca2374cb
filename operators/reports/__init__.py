"""Run reports and lineage as web pages: what the Slipway plugin serves inside the Airflow UI
(``operators/ui.py`` mounts it) and the self-contained ``report.html`` each run writes.

No Airflow imports: pages are built from the lineage store and the files the steps wrote, so
the static report, the plugin and the tests share one code path.

* ``view``: a run's lineage graph read as a report (steps, counts, training, evaluation,
  benchmarks, samples, the gate, failures and what a rerun resumes);
* ``plots``: the loss curve (matplotlib, server-side: no script from the internet);
* ``pages``: the HTML pages (Jinja2 templates in ``templates/``, autoescaped);
* ``static``: the run's ``report.html``, its images inlined.
"""

URL_PREFIX = "/slipway"  # where the plugin mounts the pages on the Airflow API server
