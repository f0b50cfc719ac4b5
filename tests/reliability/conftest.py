import os

import pytest

#: The long versions run with KVSTORE_LONG=1 (make test-long); CI runs the short ones.
LONG = os.environ.get("KVSTORE_LONG") == "1"


@pytest.fixture
def trials():
    def count(short: int, long: int = 200) -> int:
        return long if LONG else short

    return count
