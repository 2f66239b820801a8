"""The client's pieces without a server: a light import, the retry policy, error fields, request building."""

import json
import pathlib
import subprocess
import sys

import grpc
import pytest

import moemesh
from moemesh import client_errors, client_request
from moemesh.client_retry import Deadline, RetryPolicy

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)


def test_importing_the_client_pulls_in_no_torch():
    """`import moemesh` loads nothing more; moemesh.Client and AsyncClient load gRPC and the stubs, never torch."""
    script = ("import sys, moemesh\n"
              "bare = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'moe', 'torch'))\n"
              "moemesh.Client, moemesh.AsyncClient, moemesh.MoemeshError\n"
              "print(bare, sorted(m for m in sys.modules if m.split('.')[0] == 'torch'), 'grpc' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] [] True"


def test_exports():
    assert set(moemesh.__all__) <= set(dir(moemesh))
    assert moemesh.Client.__module__ == "moemesh.client" and moemesh.RetryPolicy is RetryPolicy
    with pytest.raises(AttributeError):
        moemesh.NoSuchThing


def test_backoff_grows_to_its_cap_with_jitter_below_it():
    policy = RetryPolicy(max_attempts=10, initial_backoff_s=0.1, max_backoff_s=1.0, backoff_multiplier=2.0)
    for attempt, cap in [(1, 0.1), (2, 0.2), (4, 0.8), (5, 1.0), (9, 1.0)]:
        draws = [policy.backoff_s(attempt) for _ in range(200)]
        assert all(0 <= d <= cap for d in draws) and max(draws) > cap * 0.8 and len(set(draws)) > 100


def test_only_unavailable_is_retried_within_the_attempts_and_the_deadline():
    no_deadline = Deadline(None)
    assert FAST_RETRY.retry_delay(grpc.StatusCode.UNAVAILABLE, 1, no_deadline) is not None
    assert FAST_RETRY.retry_delay(grpc.StatusCode.UNAVAILABLE, 3, no_deadline) is None
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL):
        assert FAST_RETRY.retry_delay(code, 1, no_deadline) is None
    slow = RetryPolicy(initial_backoff_s=10.0, max_backoff_s=10.0, backoff_multiplier=1.0)
    # Jitter draws in [0, 10 s]: a deadline 1 ms away leaves (almost surely) no room for the pause.
    assert sum(slow.retry_delay(grpc.StatusCode.UNAVAILABLE, 1, Deadline(0.001)) is None for _ in range(50)) >= 49
    with pytest.raises(ValueError, match="max_attempts must be at least 1, got 0"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="initial_backoff_s <= max_backoff_s"):
        RetryPolicy(initial_backoff_s=2.0, max_backoff_s=1.0)


def test_no_gateway_at_all_is_unavailable_after_the_bounded_attempts():
    with moemesh.Client("127.0.0.1:1", retry=FAST_RETRY, timeout=10) as client:
        with pytest.raises(moemesh.UnavailableError) as err:
            client.model_info()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.field is None


@pytest.mark.parametrize(("details", "field"), [
    ("sampling.top_k must be in [0, 151936], got -1", "sampling.top_k"),
    ("sampling.stop[1] must not be empty", "sampling.stop[1]"),
    ("messages: the chat template failed", "messages"),
    ("input_ids.ids must not be empty", "input_ids.ids"),
    ("", None),
])
def test_invalid_argument_names_its_field(details, field):
    error = client_errors.error(grpc.StatusCode.INVALID_ARGUMENT, details)
    assert isinstance(error, moemesh.InvalidArgumentError) and error.field == field
    assert client_errors.error(grpc.StatusCode.NOT_FOUND, "sampling.top_k x").field is None


def test_requests_mirror_sampling_params():
    request = client_request.generate_request("hi", max_new_tokens=3, temperature=0.5, top_p=0.9, top_k=4, seed=0,
                                              stop="!", json_schema={"type": "object"}, logprobs=True,
                                              top_logprobs=5, prompt_logprobs=True, n=3, request_id="r")
    s = request.sampling
    assert (request.prompt, request.request_id, s.max_new_tokens, s.top_k, s.seed, list(s.stop)) == \
        ("hi", "r", 3, 4, 0, ["!"])
    assert s.HasField("seed") and json.loads(s.json_schema) == {"type": "object"}
    assert (s.logprobs, s.top_logprobs, s.prompt_logprobs, s.n) == (True, 5, True, 3)
    assert not client_request.generate_request("hi").sampling.HasField("seed")
    assert client_request.generate_request("hi", json_object=True).sampling.WhichOneof("constraint") == "json_object"
    assert client_request.generate_request("hi", grammar="start: \"a\"").sampling.grammar == 'start: "a"'
    with pytest.raises(ValueError, match="at most one constraint may be given, got json_schema, regex"):
        client_request.generate_request("hi", json_schema="{}", regex="a")
    with pytest.raises(ValueError, match="exactly one of prompt, messages, input_ids"):
        client_request.generate_request("hi", input_ids=[1])
    with pytest.raises(ValueError, match="choice must be a sequence of texts"):
        client_request.generate_request("hi", choice="yes")
    with pytest.raises(TypeError, match="max_tokens"):
        client_request.generate_request("hi", max_tokens=3)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_new_tokens": -1}, ValueError, "^max_new_tokens: "),
    ({"top_k": 2 ** 40}, ValueError, "^top_k: "),
    ({"seed": -1}, ValueError, "^seed: "),
    ({"n": 2 ** 32}, ValueError, "^n: "),
    ({"temperature": "hot"}, TypeError, "^temperature: "),
    ({"stop": 5}, TypeError, "^stop: "),
    ({"choice": ["a", 5]}, TypeError, "^choice: "),
    ({"prompt": None, "input_ids": [1, 2 ** 40]}, ValueError, "^input_ids: "),
    ({"prompt": "\ud800"}, ValueError, "^prompt: .*surrogates not allowed"),
    ({"prompt": None, "messages": [("user", "hi"), ("user", "\udc80")]}, ValueError, r"^messages\[1\]: "),
    ({"prompt": None, "messages": [("user",)]}, ValueError, r"^messages\[0\] must be a dict"),
])
def test_what_the_proto_cannot_hold_is_refused_naming_the_argument(kwargs, error, match):
    # Protobuf's own messages ("Value out of range: -1") do not say which argument.
    with pytest.raises(error, match=match):
        client_request.generate_request(**{"prompt": "hi", **kwargs})
