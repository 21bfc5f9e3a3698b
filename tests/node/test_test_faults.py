"""NEXRT_TEST_FAULTS (test-only fault injection) parses what it documents and refuses the rest
with the variable's name; unset means no fault."""
import pytest

from nexrt_vllm.node.faults import ENV, Faults, from_env


def test_parse():
    assert not from_env("") and from_env("") == Faults()
    f = from_env("refuse_begin, stall_first_token=2.5")
    assert (f.refuse_begin, f.stall_first_token_s) == (1.0, 2.5) and f.refuse()
    f = from_env("refuse_begin=0.25")
    share = sum(f.refuse() for _ in range(4000)) / 4000
    assert 0.2 < share < 0.3


@pytest.mark.parametrize("bad", ["refuse", "refuse_begin=x", "refuse_begin=2", "stall_first_token=-1",
                                 "stall_first_token"])
def test_bad_values_name_the_variable(bad):
    with pytest.raises(ValueError, match=ENV):
        from_env(bad)
