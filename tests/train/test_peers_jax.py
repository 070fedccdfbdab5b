"""The private JAX API train.process.peers and train.process.stop rely on (jax.distributed's key-value client: no
public accessor exists up to jax 0.11.1) still exists in the installed JAX and behaves as they
assume. When a JAX release changes it, this fails saying what changed."""

import os
import socket
import subprocess
import sys
import textwrap

import jax

from train.process import peers

from tests.helpers.flags import TEST_XLA_FLAGS
from tests.helpers.trainer import ROOT


def test_the_client_is_none_without_jax_distributed():
    assert not jax.distributed.is_initialized()
    assert peers.distributed_client() is None


def test_the_private_client_exists_and_behaves_as_train_peers_assumes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = textwrap.dedent(f"""
        import jax
        jax.distributed.initialize("127.0.0.1:{port}", num_processes=1, process_id=0)
        from train.process import peers
        client = peers.distributed_client()
        assert client is not None, "distributed_client() is None after jax.distributed.initialize"
        missing = [m for m in peers.CLIENT_METHODS if not callable(getattr(client, m, None))]
        assert not missing, f"the client ({{type(client).__name__}}) lacks {{missing}}"
        # train.process.stop: the first set of a key wins, a second set without overwrite fails
        client.key_value_set("t/1/after", "5")
        try:
            client.key_value_set("t/1/after", "6")
        except Exception as e:
            assert "ALREADY_EXISTS" in str(e), f"a second set failed otherwise: {{e}}"
        else:
            raise AssertionError("a second set without allow_overwrite replaced the value")
        # train.process.peers: overwrite, and a directory read lists (key, value) pairs below it
        client.key_value_set("t/1/beat/0", "1", allow_overwrite=True)
        client.key_value_set("t/1/beat/0", "2", allow_overwrite=True)
        found = sorted(client.key_value_dir_get("t/1/"))
        assert found == [("t/1/after", "5"), ("t/1/beat/0", "2")], found
        assert client.key_value_dir_get("t/2/") == [], "a read of an empty directory"
        print("ok", jax.__version__)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # tests/helpers/flags.py; the device count is the run's
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, (
        f"jax {jax.__version__} changed what train.process.peers.distributed_client reads "
        f"({peers.PRIVATE_CLIENT}) or how that client behaves; update train/process/peers.py and "
        f"train/process/stop.py:\n{result.stderr[-2000:]}")
