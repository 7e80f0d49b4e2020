"""The `branchsearch` command line: one module per command group, registered from one list
(`main.COMMAND_GROUPS`).

    main      the app, `main` (every user-caused error as one `error:` line) and `user_error`
    options   what every command shares: options, the settings merge, ACL groups, progress bar
    index     ingest, indexes, synth
    search    retrieve, search
    jobs      batch, eval, loadtest, demo
    serve     serve, keys
    render    what is printed: text safe for a terminal, the result, evaluation and demo views
"""

from branchsearch.orchestrator.cli.main import app, main, user_error

__all__ = ["app", "main", "user_error"]
