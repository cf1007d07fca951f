"""``python -m fluksio_nb.worker``: the process a claimed cell runs in."""

from fluksio_nb.worker.main import main

raise SystemExit(main())
