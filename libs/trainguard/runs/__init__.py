"""Dataset manifests and run records: what a job trains on, and what each run ran with.

Client-side: a rank, the Checkpointer and the CLI use it, so it imports neither the
service stack nor torch (it reads torch's versions only when the trainer loaded it).

- :func:`build_manifest`, :func:`verify`, :func:`check_data`: a data set's files, sizes and
  XXH3-128 hashes (in full or sampled), and the check a job runs at start and at resume.
- :func:`collect_run_record`, :func:`write_run_record`, :func:`read_run_record`,
  :func:`diff_records`: the ``run.json`` beside every checkpoint.
"""

from __future__ import annotations

from .diff import diff_records
from .manifest import ManifestError, build_manifest, read_manifest, write_manifest
from .record import RunRecordError, collect_run_record, read_run_record, write_run_record
from .verify import DataMismatch, DataRefused, check_data, verify

__all__ = [
    "DataMismatch",
    "DataRefused",
    "ManifestError",
    "RunRecordError",
    "build_manifest",
    "check_data",
    "collect_run_record",
    "diff_records",
    "read_manifest",
    "read_run_record",
    "verify",
    "write_manifest",
    "write_run_record",
]
