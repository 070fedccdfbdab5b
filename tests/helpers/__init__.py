"""What the tests share; a test file imports helpers from here, never from another test file.

    from tests.helpers import hf_tiny                          # tiny random Hugging Face models
    from tests.helpers.one_device import assert_equal_to_one_device  # a mesh's loss and gradients
    from tests.helpers.reference import reference_attention   # independent single-device references
    from tests.helpers.trainer import tiny_config             # tiny trainer configs and runs
    from tests.helpers.trees import flat_params, flat_state   # trees as flat dicts of arrays
"""
