from starhub.cli import main

raise SystemExit(main())
