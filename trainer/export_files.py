"""The names of a Hugging Face export folder's own files (``trainer/export.py`` writes them).

Named here, apart from the exporter, so that the operators can find a finished export without
importing it: the exporter pulls in NumPy and ml_dtypes, and Airflow parses DAG files often.
Standard library only.
"""

from __future__ import annotations

import re

PROVENANCE = "slipway_export.json"  # written last: its presence marks a finished export
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # beside model-0000k-of-0000n.safetensors
WEIGHT_SHARD = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")
