"""The service's settings: from the environment (KVSCOPE_*), a .env file, or `kvscope serve` options."""

from __future__ import annotations

import secrets
from importlib import resources
from pathlib import Path

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSCOPE_", env_file=".env", extra="ignore")

    host: str = Field("127.0.0.1", description="address to bind; loopback unless you mean to expose it")
    port: int = Field(8321, ge=0, le=65535)
    db: Path = Field(Path("kvscope.duckdb"), description="the verifier database A/B runs are recorded into")
    token: SecretStr | None = Field(
        None, description="bearer token for mutating endpoints; a random one is made (and printed) when unset"
    )  # never None once validated: _make_token fills it in
    max_body_bytes: int = Field(1_000_000, gt=0, description="request bodies larger than this get 413")
    workdir: Path = Field(Path("out/ab"), description="folder for file-backend tiers of A/B tests")
    criteria: list[Path] = Field(
        default_factory=list, description="criteria files applied when an A/B ends, if its arms fill their roles"
    )
    targets: Path | None = Field(None, description="exporter configuration of live clusters to scrape and watch")
    scrape_interval_s: float = Field(5.0, gt=0, description="how often the published A/B engines are scraped")
    ab_retain_s: float = Field(300.0, ge=0, description="an ended A/B's engines stay on /metrics this long")
    max_running_ab: int = Field(8, ge=1, description="A/Bs running at once; one more is refused with 409")
    max_real_bytes: int = Field(
        4 * 1024**3, ge=0, description="bytes the memory and file tiers of all running A/Bs may hold together"
    )
    max_real_store_ab: int = Field(
        1, ge=0, description="A/Bs with real-store arms (Mooncake processes) running at once; 0 refuses them"
    )
    alertmanager_url: str | None = Field(None, description="forward alerts to this Alertmanager (/api/v2/alerts)")
    alert_resend_s: float = Field(30.0, gt=0, description="re-send active alerts this often (Alertmanager expires)")
    dashboards_dir: Path = Field(
        default_factory=lambda: Path(str(resources.files("kvscope.dashboards"))),
        description="generated Grafana dashboards (JSON); default: the ones kvscope ships",
    )
    grafana_url: str | None = None
    grafana_token: SecretStr | None = None
    _token_generated: bool = PrivateAttr(False)

    @field_validator("criteria")
    @classmethod
    def _criteria_exist(cls, paths: list[Path]) -> list[Path]:
        """A configured criteria file that is not there stops the start, naming it (it is never skipped)."""
        for path in paths:
            if not path.is_file():
                raise ValueError(f"{path}: no such criteria file")
        return paths

    @model_validator(mode="after")
    def _make_token(self) -> Settings:
        if self.token is None:
            self.token, self._token_generated = SecretStr(secrets.token_urlsafe(24)), True
        return self

    @property
    def token_generated(self) -> bool:
        """Whether the token was made up at start (then it must be shown once; a configured one never is)."""
        return self._token_generated
