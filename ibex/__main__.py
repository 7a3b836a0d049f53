from ibex.cli import main

raise SystemExit(main())
