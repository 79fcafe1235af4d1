"""Whether a Prefect server is configured, read without importing Prefect: every place Prefect
itself reads it from counts, so the CLI never starts its own server beside a configured one."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowtide.settings import prefect_server_configured


@pytest.fixture
def bare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("PREFECT_API_URL", "PREFECT_PROFILES_PATH", "PREFECT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("file", "text"),
    [
        (".env", "PREFECT_API_URL=http://team-server:4200/api\n"),
        ("pyproject.toml", '[tool.prefect.api]\nurl = "http://team-server:4200/api"\n'),
        ("prefect.toml", '[api]\nurl = "http://team-server:4200/api"\n'),
        ("home/profiles.toml", 'active = "t"\n[profiles.t]\nPREFECT_API_URL = "http://x/api"\n'),
    ],
)
def test_a_server_named_where_prefect_reads_it_counts(bare: Path, file: str, text: str) -> None:
    assert not prefect_server_configured(bare / "home")
    (bare / file).parent.mkdir(parents=True, exist_ok=True)
    (bare / file).write_text(text, encoding="utf-8")
    assert prefect_server_configured(bare / "home")


def test_files_that_name_no_server_do_not_count(bare: Path) -> None:
    (bare / ".env").write_text("OPENAI_API_KEY=sk-not-a-server\n", encoding="utf-8")
    (bare / "pyproject.toml").write_text('[project]\nname = "x"\n', encoding="utf-8")
    assert not prefect_server_configured(bare / "home")
