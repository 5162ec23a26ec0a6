from weightbus.apps.cli import main

raise SystemExit(main())
