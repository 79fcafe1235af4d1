"""Provider keys: the environment first, then the Prefect Secret block the job names; one line
naming both places when neither has a key, and never the key itself in a message."""

from __future__ import annotations

import uuid

import pytest
from prefect.blocks.system import Secret

from lowtide.backends import make_backend
from lowtide.backends.keys import require_key
from lowtide.errors import TerminalBackendError

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture
def block() -> str:
    """A fresh Secret block name (the harness's Prefect is shared by the session)."""
    return f"lowtide-key-{uuid.uuid4().hex[:12]}"


def test_the_environment_wins_over_the_block(block: str, monkeypatch: pytest.MonkeyPatch) -> None:
    Secret(value="sk-from-block").save(block)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    assert require_key("openai", "OPENAI_API_KEY", block) == "sk-from-env"


def test_the_block_is_read_when_the_variable_is_unset(block: str) -> None:
    Secret(value=" sk-test-123 ").save(block)
    assert require_key("openai", "OPENAI_API_KEY", block) == "sk-test-123"
    Secret(value="12345").save(block, overwrite=True)  # kept as text, not parsed as JSON
    assert require_key("anthropic", "ANTHROPIC_API_KEY", block) == "12345"


def test_neither_place_is_one_line_naming_both(block: str) -> None:
    with pytest.raises(TerminalBackendError) as info:
        require_key("openai", "OPENAI_API_KEY", block)
    assert str(info.value) == (
        f"No API key for backend 'openai': set OPENAI_API_KEY or save the key in the Prefect "
        f"Secret block {block!r} (looked in: environment, Prefect Secret block {block!r}: no "
        "such block)."
    )
    assert info.value.backend == "openai" and info.value.operation == "config"


def test_a_block_without_a_key_string_is_refused_without_showing_it(block: str) -> None:
    Secret(value={"key": "sk-secret-json"}).save(block)
    with pytest.raises(TerminalBackendError, match="it holds a JSON value") as info:
        require_key("anthropic", "ANTHROPIC_API_KEY", block)
    assert "sk-secret-json" not in str(info.value)
    Secret(value="  ").save(block, overwrite=True)
    with pytest.raises(TerminalBackendError, match=f"block {block!r}: it is empty"):
        require_key("anthropic", "ANTHROPIC_API_KEY", block)


def test_without_a_block_the_message_says_how_to_name_one() -> None:
    with pytest.raises(TerminalBackendError, match=r"name it in the job file's \[model\] api_key"):
        require_key("openai", "OPENAI_API_KEY")


@pytest.mark.parametrize("name", ["openai", "anthropic"])
def test_the_factories_take_the_block_from_the_connection(name: str, block: str) -> None:
    with pytest.raises(TerminalBackendError, match=f"Prefect Secret block {block!r}"):
        make_backend(name, api_key_block=block)
    Secret(value="sk-test-factory").save(block)
    assert make_backend(name, api_key_block=block).capabilities.name == name
