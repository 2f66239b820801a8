"""The gateway's API key store (gateway/auth.py): the file, reloads, classes, rate and stream limits."""

import json
import os

import pytest

from gateway.auth import AuthCode, AuthError, KeyStore, bearer_token, hash_key, new_key, parse_key_file


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def write_keys(path, entries) -> None:
    path.write_text(json.dumps({"keys": entries}))
    # A new mtime even within the file system's timestamp granularity.
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


@pytest.fixture
def keys():
    return {"a": new_key(), "b": new_key()}


@pytest.fixture
def store(tmp_path, keys):
    path = tmp_path / "keys.json"
    write_keys(path, [
        {"name": "a", "sha256": hash_key(keys["a"]), "requests_per_s": 2, "burst": 2, "max_streams": 1},
        {"name": "b", "sha256": hash_key(keys["b"]), "priorities": ["batch"]},
    ])
    clock = Clock()
    return KeyStore(str(path), clock=clock, reload_interval_s=1.0), clock, path


def code_of(fn) -> AuthCode:
    with pytest.raises(AuthError) as caught:
        fn()
    return caught.value.code


def test_a_token_is_its_key_and_no_token_or_a_wrong_one_is_unauthenticated(store, keys):
    store, _, _ = store
    assert store.authenticate(keys["a"]).name == "a"
    assert code_of(lambda: store.authenticate(None)) is AuthCode.UNAUTHENTICATED
    assert code_of(lambda: store.authenticate(keys["a"] + "x")) is AuthCode.UNAUTHENTICATED


def test_a_key_removed_from_the_file_is_refused_after_the_reload_interval(store, keys):
    store, clock, path = store
    write_keys(path, [{"name": "b", "sha256": hash_key(keys["b"])}])
    assert store.authenticate(keys["a"]).name == "a"  # not checked again yet
    clock.now += 1.0
    assert code_of(lambda: store.authenticate(keys["a"])) is AuthCode.UNAUTHENTICATED
    assert store.authenticate(keys["b"]).name == "b"


def test_a_file_that_does_not_parse_keeps_the_keys_read_before(store, keys, caplog):
    store, clock, path = store
    path.write_text("{not json")
    clock.now += 5.0
    assert store.authenticate(keys["a"]).name == "a"
    assert "not reloaded" in caplog.text


def test_the_rate_is_a_token_bucket_with_a_retry_hint(store, keys):
    store, clock, _ = store
    key = store.authenticate(keys["a"])
    store.take_request(key)
    store.take_request(key)
    with pytest.raises(AuthError) as caught:
        store.take_request(key)
    assert caught.value.code is AuthCode.RESOURCE_EXHAUSTED
    assert caught.value.retry_after_s == pytest.approx(0.5)
    clock.now += 0.5
    store.take_request(key)
    other = store.authenticate(keys["b"])
    for _ in range(100):  # no limit on b, and a's bucket is a's alone
        store.take_request(other)


def test_streams_are_counted_per_key_and_returned_on_close(store, keys):
    store, _, _ = store
    key = store.authenticate(keys["a"])
    close = store.open_stream(key)
    assert code_of(lambda: store.open_stream(key)) is AuthCode.RESOURCE_EXHAUSTED
    close()
    store.open_stream(key)()


def test_a_key_may_be_limited_to_some_priority_classes(store, keys):
    store, _, _ = store
    batch_only = store.authenticate(keys["b"])
    assert code_of(lambda: store.admit_generate(batch_only, "interactive")) is AuthCode.PERMISSION_DENIED
    store.admit_generate(batch_only, "batch")()


def test_the_key_never_appears_in_errors_or_logs(store, keys, caplog):
    store, clock, path = store
    messages = []
    for attempt in (lambda: store.authenticate(keys["a"][:-1]),
                    lambda: store.admit_generate(store.authenticate(keys["b"]), "interactive")):
        with pytest.raises(AuthError) as caught:
            attempt()
        messages.append(caught.value.message)
    write_keys(path, [{"name": "b", "sha256": hash_key(keys["b"])}])
    clock.now += 2
    store.authenticate(keys["b"])
    for key in keys.values():
        assert key not in caplog.text and not any(key[:-1] in m for m in messages)


@pytest.mark.parametrize("text,match", [
    ("[]", "an object"), ("{", "not JSON"), ('{"keys": [{"name": "x", "sha256": "ab"}]}', "64 lowercase hex"),
    ('{"keys": [{"sha256": "%s"}]}' % ("0" * 64), "needs a name"),
    ('{"keys": [{"name": "x", "sha256": "%s", "priorities": ["urgent"]}]}' % ("0" * 64), "unknown priorities"),
    ('{"keys": [{"name": "x", "sha256": "%s"}, {"name": "x", "sha256": "%s"}]}' % ("0" * 64, "1" * 64), "unique"),
])
def test_a_bad_key_file_is_refused_naming_the_problem(text, match):
    with pytest.raises(ValueError, match=match):
        parse_key_file(text)


def test_a_missing_key_file_fails_the_start(tmp_path):
    with pytest.raises(ValueError, match="api key file"):
        KeyStore(str(tmp_path / "none.json"))


@pytest.mark.parametrize("value,token", [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None),
                                         ("Bearer", None), ("", None), (None, None)])
def test_bearer_tokens(value, token):
    assert bearer_token(value) == token
