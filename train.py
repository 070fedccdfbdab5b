"""python train.py --config configs/NAME.yaml [key.sub=value ...]  (see train/cli.py)"""

import sys

from train.cli import main

if __name__ == "__main__":
    sys.exit(main())
