"""The one-line error check the model tests share."""

import pytest


def assert_one_line_model_error(fn, *fragments) -> str:
    """fn() raises models.ModelError with a one-line message that holds every fragment; the
    message."""
    import models

    with pytest.raises(models.ModelError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message
