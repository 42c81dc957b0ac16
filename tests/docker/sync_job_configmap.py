"""Copy docker/examples/keras_smiquery_train.py into the ConfigMap of docker/k8s/tensorflow-job.yaml.

tests/test_docker.py fails when the two copies differ; run ``python tests/docker/sync_job_configmap.py`` after
editing the example.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "examples" / "keras_smiquery_train.py"
JOB = ROOT / "docker" / "k8s" / "tensorflow-job.yaml"
KEY = "  keras_smiquery_train.py: |\n"


def synced(job_text: str, script_text: str) -> str:
    """The job manifest with the ConfigMap's script block replaced by ``script_text``."""
    start = job_text.index(KEY) + len(KEY)
    end = job_text.index("\n---\n", start) + 1
    block = "".join(("    " + line) if line.strip() else line for line in script_text.splitlines(keepends=True))
    return job_text[:start] + block + job_text[end:]


def main() -> int:
    old = JOB.read_text(encoding="utf-8")
    new = synced(old, SCRIPT.read_text(encoding="utf-8"))
    if new != old:
        JOB.write_text(new, encoding="utf-8")
        print(f"updated {JOB.relative_to(ROOT)}")
    else:
        print(f"{JOB.relative_to(ROOT)} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
