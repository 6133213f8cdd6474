import sys

from byteps.scheduler import main

sys.exit(main())
