#!/bin/bash
# The transfer set (lab/transfer.py's doc) from nothing: its third-party servers installed, its rows written and
# checked (every row's oracle calls score 1.0 and a wrong answer 0.0 on the real servers). From the repository root,
# in the project's environment (git needs the git CLI):
#   bash lab/recipes/transfer.sh [OUT]      OUT: data/out/transfer
#   TRAIN=1      the user's case too: training rows for the same servers over a world of their own (OUT-train)
#   WHEELS=DIR   install from the wheel files in DIR only (a machine without a package index)
# mcp-server-git, excel-mcp-server and mcp-server-time go beside the project (mcp 2.x); mcp-server-sqlite 2025.4.25
# needs mcp<2, so it gets a venv of its own (SQLITE_VENV, default ~/.cache/nanorl/sqlite-mcp).
set -euo pipefail
out=${1:-data/out/transfer}
venv=${SQLITE_VENV:-$HOME/.cache/nanorl/sqlite-mcp}
from=(); [ -z "${WHEELS:-}" ] || from=(--no-index --find-links "$WHEELS")
python -c "import mcp_server_git, excel_mcp, mcp_server_time" 2>/dev/null ||
  python -m pip install -q "${from[@]}" mcp-server-git excel-mcp-server mcp-server-time
if [ ! -x "$venv/bin/mcp-server-sqlite" ]; then
  python -m venv "$venv"
  env -u PYTHONPATH "$venv/bin/python" -m pip install -q "${from[@]}" mcp-server-sqlite==2025.4.25 'mcp>=1.6,<2'  # its own mcp only
fi
python lab/transfer.py --out "$out" --sqlite-server "$venv/bin/mcp-server-sqlite"
python lab/transfer.py --out "$out" --check
if [ -n "${TRAIN:-}" ]; then
  python lab/transfer.py --split train --out "$out-train" --sqlite-server "$venv/bin/mcp-server-sqlite" --exclude "$out/rows.jsonl"
fi
