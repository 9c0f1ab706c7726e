"""`python -m rlmesh.cli` is the `rlmesh` command."""

from rlmesh.cli import main

main()
