from transformer_cli.main import main

raise SystemExit(main())
