from dflash.cli import main

raise SystemExit(main())
