"""python train.py --config configs/NAME.yaml [key.sub=value ...]  (see train/cli.py)"""

from train.cli import exit_with, main

if __name__ == "__main__":
    exit_with(main(exiting=True))
