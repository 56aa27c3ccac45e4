"""Prove that ``pip install 'gputq[rdma,ray]'`` alone gives a working rdma transport.

Creates a scratch venv (outside the repository), installs the pinned CPU
torch first (as ``make`` does), then this checkout with the ``rdma`` and
``ray`` extras and nothing else, and runs ``gputq demo --transport rdma
--json`` from a neutral folder. Exits 0 when the demo reports
``verified: true`` over rdma. Takes a few minutes (mostly the downloads).

Usage: ``python3 scripts/install_check.py [--venv DIR] [--keep]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=None, help="venv folder (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the venv afterwards")
    args = parser.parse_args()
    venv = args.venv or tempfile.mkdtemp(prefix="gputq-install-check-")
    try:
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q"]
        subprocess.run(pip + ["torch==2.13.0"], check=True)
        subprocess.run(pip + [f"{ROOT}[rdma,ray]"], check=True)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("GPUTQ_")}
        done = subprocess.run([os.path.join(venv, "bin", "gputq"), "demo", "--transport", "rdma", "--json",
                               "--sessions", "2", "--steps", "2", "--layers", "4", "--topk", "2",
                               "--tokens", "64"], cwd=tempfile.gettempdir(), env=env,
                              capture_output=True, text=True, timeout=600)
        lines = done.stdout.strip().splitlines()
        result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
        ok = done.returncode == 0 and result.get("verified") is True and result.get("transport") == ["rdma"]
        print(f"install check: verified={result.get('verified')} transport={result.get('transport')} "
              f"-> {'OK' if ok else 'FAILED'}")
        if not ok:
            print(done.stderr[-3000:], file=sys.stderr)
        return 0 if ok else 1
    finally:
        if not args.keep and args.venv is None:
            shutil.rmtree(venv, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
