"""Runs benchmark scripts as ``python SCRIPT ARGS...`` would, each in a fork of this one
process, which imports torch, Lightning, transformers and the package once: a script's
refusal of bad arguments costs a fork, not an interpreter start.

    python tests/refused_arguments.py CASES.json RESULTS.json

CASES.json holds a list of ``{"script": path, "argv": [...], "env": {...}}``; RESULTS.json
gets, per case, its exit status and what it printed on stdout and stderr."""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback
from pathlib import Path


def run_case(script: str, argv: list[str], env: dict[str, str]) -> dict:
    """Runs ``script`` with ``argv`` in a forked child, as its ``__main__``: the child's exit
    status and output."""
    with tempfile.TemporaryDirectory() as folder:
        stdout, stderr = Path(folder) / "stdout", Path(folder) / "stderr"
        pid = os.fork()
        if pid == 0:  # the child: the script's process from here on
            code = 1
            try:
                with open(stdout, "w") as out, open(stderr, "w") as err:
                    os.dup2(out.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                os.environ.update(env)
                sys.argv = [script, *argv]
                sys.path.insert(0, str(Path(script).parent))  # as `python SCRIPT` puts it
                try:
                    runpy.run_path(script, run_name="__main__")
                    code = 0
                except SystemExit as exit:
                    if exit.code is None or isinstance(exit.code, int):
                        code = exit.code or 0
                    else:  # sys.exit("message"): on stderr, status 1, as the interpreter does
                        print(exit.code, file=sys.stderr)
                        code = 1
                except BaseException:
                    traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return {"returncode": os.waitstatus_to_exitcode(status), "stdout": stdout.read_text(),
                "stderr": stderr.read_text()}


if __name__ == "__main__":
    import pytorch_lightning  # noqa: F401  (what the scripts import: loaded once, here)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import sparse_training  # noqa: F401

    cases = json.loads(Path(sys.argv[1]).read_text())
    results = [run_case(case["script"], case["argv"], case.get("env", {})) for case in cases]
    Path(sys.argv[2]).write_text(json.dumps(results))
