from weightbus.cli import main

raise SystemExit(main())
