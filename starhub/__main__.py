from starhub.cli.main import main

raise SystemExit(main())
