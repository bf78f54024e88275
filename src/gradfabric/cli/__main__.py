from gradfabric.cli import main

raise SystemExit(main())
