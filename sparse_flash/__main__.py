"""`python -m sparse_flash`: the `sparse-flash` command."""

from .cli import main

raise SystemExit(main())
