import sys

from mmpack.cli import main

sys.exit(main())
