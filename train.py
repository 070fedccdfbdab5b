"""python train.py --config configs/NAME.yaml [key.sub=value ...]  (see train/cli.py)"""

if __name__ == "__main__":
    import os
    import signal

    def _interrupted(signum, frame):  # until train.cli is imported (it installs the same)
        os.write(2, f"error: interrupted: {signal.Signals(signum).name} during start-up\n".encode())
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)

    from train.cli import exit_with, main

    exit_with(main(exiting=True))
