"""`python -m branchsearch.orchestrator.cli`: the `branchsearch` command."""

from branchsearch.orchestrator.cli.main import main

if __name__ == "__main__":
    main()
