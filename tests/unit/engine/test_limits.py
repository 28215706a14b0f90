"""The one request-limits check shared by the ingress and the engine (engine.limits)."""
import pytest

from affinity_serve.engine.errors import ContextLengthExceededError, InvalidRequestError
from affinity_serve.engine.limits import EngineLimits

LIMITS = EngineLimits(max_model_len=16, vocab_size=100, max_kv_tokens=32)


@pytest.mark.parametrize("prompt,max_tokens,err,param", [
    ([], 4, InvalidRequestError, "prompt"),
    (0, 4, InvalidRequestError, "prompt"),
    ([1] * 16, 1, ContextLengthExceededError, "prompt"),
    (16, 1, ContextLengthExceededError, "prompt"),
    ([1, 100], 4, InvalidRequestError, "prompt"),
    ([1, -1], 4, InvalidRequestError, "prompt"),
    ([1, 2], 0, InvalidRequestError, "max_tokens"),
])
def test_check_rejects(prompt, max_tokens, err, param):
    with pytest.raises(err) as e:
        LIMITS.check(prompt, max_tokens)
    assert e.value.param == param and e.value.code and e.value.message


def test_check_accepts_and_caps_output_at_the_context():
    LIMITS.check([1, 99], 1000)             # stops at max_model_len with finish_reason "length"
    EngineLimits(16, None, 32).check([10**6], 4)   # no vocabulary known: ids are not range-checked
    with pytest.raises(ContextLengthExceededError) as e:
        EngineLimits(max_model_len=64, vocab_size=None, max_kv_tokens=32).check(10, 100)
    assert e.value.param == "max_tokens" and "KV cache" in e.value.message


def test_the_api_contract_also_needs_prompt_plus_max_tokens_in_the_context():
    LIMITS.check_fits_context([1] * 10, 6)
    with pytest.raises(ContextLengthExceededError) as e:
        LIMITS.check_fits_context([1] * 10, 7)
    assert e.value.param == "max_tokens" and "16" in e.value.message
    with pytest.raises(ContextLengthExceededError) as e:
        LIMITS.check_fits_context([1] * 20, 1)
    assert e.value.param == "prompt"


def test_limits_are_torch_free():
    import subprocess
    import sys
    code = "import sys, engine.limits; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
