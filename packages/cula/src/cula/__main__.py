"""`python -m cula info | demo`: see cula_core.cli."""

from cula_core.cli import main

raise SystemExit(main())
