"""The dated price table: USD per million tokens by provider and model."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from pathlib import Path

import polars as pl

from lowtide.errors import PriceError, PriceTableError


@dataclass(frozen=True)
class Price:
    provider: str
    model: str
    effective_date: str
    input: float  # USD per million input tokens, realtime list price
    cached_input: float
    output: float
    batch_discount: float  # multiplier for batch usage, e.g. 0.5

    def cost(
        self, input_tokens: int, cached_tokens: int, output_tokens: int, *, batch: bool
    ) -> float:
        """USD for this usage. `input_tokens` includes `cached_tokens` (OpenAI's convention)."""
        fresh = max(0, input_tokens - cached_tokens)
        usd = (
            fresh * self.input + cached_tokens * self.cached_input + output_tokens * self.output
        ) / 1e6
        return usd * (self.batch_discount if batch else 1.0)

    def per_mtok(self) -> dict[str, float]:
        return {
            "input": self.input * self.batch_discount,
            "output": self.output * self.batch_discount,
            "batch_discount": self.batch_discount,
        }


PRICE_COLUMNS = {
    "provider": pl.String,
    "model": pl.String,
    "effective_date": pl.String,
    "input_usd_per_mtok": pl.Float64,
    "cached_input_usd_per_mtok": pl.Float64,
    "output_usd_per_mtok": pl.Float64,
    "batch_discount": pl.Float64,
}


def _read_prices(path: Path) -> pl.DataFrame:
    """The price table, checked: its columns, numbers that are prices, discounts that are a
    fraction of the list price."""
    try:
        prices = pl.read_csv(path, schema_overrides=PRICE_COLUMNS, encoding="utf8")
    except (pl.exceptions.PolarsError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PriceTableError(
            f"{path}: not a readable price table ({first}); it needs the columns "
            f"{', '.join(PRICE_COLUMNS)}"
        ) from e
    missing = [c for c in PRICE_COLUMNS if c not in prices.columns]
    if missing:
        raise PriceTableError(f"{path}: price table lacks column(s) {missing}")
    numbers = [c for c, t in PRICE_COLUMNS.items() if t == pl.Float64]
    checked = prices.with_row_index("row").with_columns(
        pl.any_horizontal([pl.col(c).is_null() | (pl.col(c) < 0) for c in numbers]).alias("bad"),
        (pl.col("batch_discount") > 1).alias("bad_discount"),
    )
    bad = checked.filter(pl.col("bad") | pl.col("bad_discount"))
    if bad.height:
        r = bad.row(0, named=True)
        what = (
            f"batch_discount {r['batch_discount']} is above 1 (it multiplies the list price: "
            "0.5 for half price)"
            if r["bad_discount"]
            else "a price is missing or negative"
        )
        raise PriceTableError(
            f"{path}: line {r['row'] + 2} ({r['provider']}, {r['model']}): {what}; fix that row"
        )
    return prices


def load_price(
    table: str | Path | None, provider: str, model: str, on: date | None = None
) -> Price:
    """The newest row for (provider, model) effective on `on` (today by default)."""
    if table is None:
        raise PriceError(f"no price table: set [cost] price_table in the job file to price {model}")
    path = Path(table)
    if not path.is_file():
        raise PriceError(f"{path}: price table not found ([cost] price_table)")
    prices = _read_prices(path)
    on_s = (on or date.today()).isoformat()
    rows = prices.filter(
        (pl.col("provider") == provider)
        & (pl.col("model") == model)
        & (pl.col("effective_date") <= on_s)
    ).sort("effective_date")
    if rows.is_empty():
        raise PriceError(
            f"{path}: no price for provider {provider!r}, model {model!r} effective on {on_s}; "
            "add a row for it"
        )
    r = rows.row(-1, named=True)
    return Price(
        provider=provider,
        model=model,
        effective_date=str(r["effective_date"]),
        input=float(r["input_usd_per_mtok"]),
        cached_input=float(r["cached_input_usd_per_mtok"]),
        output=float(r["output_usd_per_mtok"]),
        batch_discount=float(r["batch_discount"]),
    )
