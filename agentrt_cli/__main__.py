from agentrt_cli import main

raise SystemExit(main())
