"""`python -m cula_core info | demo` (the same as `python -m cula ...`)."""

from cula_core.cli import main

raise SystemExit(main())
