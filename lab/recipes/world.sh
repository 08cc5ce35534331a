#!/bin/bash
# The training world (lab/world.py's doc) from nothing: its three third-party servers installed, its world and rows
# written and checked (every row's oracle calls score 1.0 and a wrong answer 0.0 on the real servers). From the
# repository root, in the project's environment:
#   bash lab/recipes/world.sh [OUT]      OUT: data/out/world
#   WHEELS=DIR   install from the wheel files in DIR only (a machine without a package index)
# All three go beside the project: none changes a package the project has (pip install --dry-run against its venv:
# only new packages; filesystem-mcp and mcp-server-motherduck's fastmcp 4.2.3 run on the project's mcp 2.x,
# kanban-mcp has its own JSON-RPC loop). kanban-mcp goes in without its dependencies: its MCP server needs only the
# standard library (and PyYAML, python-dotenv if present); Flask, gunicorn, waitress and GitPython serve its web UI.
set -euo pipefail
out=${1:-data/out/world}
from=(); [ -z "${WHEELS:-}" ] || from=(--no-index --find-links "$WHEELS")
python -c "import mcp_server_motherduck, filesystem_mcp" 2>/dev/null ||
  python -m pip install -q "${from[@]}" mcp-server-motherduck==1.1.0 filesystem-mcp==1.0.2
python -c "import kanban_mcp" 2>/dev/null || python -m pip install -q "${from[@]}" --no-deps kanban-mcp==0.2.0
bin=$(python -c "import sys, os; print(os.path.dirname(sys.executable))")
python lab/world.py --out "$out" --duck-server "$bin/mcp-server-motherduck" --kanban-server "$bin/kanban-mcp" \
  --fs-server "$bin/filesystem-mcp"
python lab/world.py --out "$out" --check
