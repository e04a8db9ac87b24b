import mmpack
from mmpack import errors


def test_version_is_single_sourced_from_cargo() -> None:
    assert mmpack.__version__.count(".") == 2


def test_errors_are_value_errors() -> None:
    assert issubclass(errors.MmpackError, ValueError)
    assert issubclass(errors.IndexOverflowError, errors.MmpackError)
