"""The migrations that depend on what the state file holds (its storage format, each job's
tables), as the steps `lowtide.store.migrations` numbers and applies. Like the numbered list,
never edit a step that has shipped."""

from __future__ import annotations

import duckdb


def storage_takes_compression(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the file is in DuckDB's 2.x storage format, the one that can be told which
    compression a column uses (a v1.0.0 file refuses the clause)."""
    storage = con.execute(
        "SELECT tags['storage_version'] FROM duckdb_databases() "
        "WHERE database_name = current_database()"
    ).fetchall()
    return str(storage[0][0] or "").startswith("v2.")


def messages_kept_apart(con: duckdb.DuckDBPyConnection) -> None:
    # zstd, not DuckDB's own pick (DICT_FSST): per 100k messages 0.9 s less CPU to store, 0.25 s
    # more to read once, 13 MB less. An older file keeps DuckDB's pick.
    compressed = " USING COMPRESSION zstd" if storage_takes_compression(con) else ""
    con.execute(
        f"""
        CREATE TABLE request_templates (
            template_id VARCHAR PRIMARY KEY,
            head VARCHAR NOT NULL,            -- line = head "custom_id" mid "message" tail
            mid VARCHAR NOT NULL,
            tail VARCHAR NOT NULL
        );
        ALTER TABLE requests ADD COLUMN user_message VARCHAR{compressed};
        ALTER TABLE requests ADD COLUMN template_id VARCHAR;
        ALTER TABLE requests ALTER COLUMN line DROP NOT NULL;  -- only for lines sent as they are
        """
    )


def store_sources_once(con: duckdb.DuckDBPyConnection) -> None:
    from lowtide.store.sources import split_copied_sources  # here: it needs the store's parts

    split_copied_sources(con)


UNKEYED = {
    "results": {},
    "batch_requests": {},
    "requests": {"user_message": "zstd"},
    "units": {},
}
"""The tables migration 16 rebuilds without their primary key, with the compression a column
keeps (where the file's format can be told)."""


def keyed_by_lowtide(con: duckdb.DuckDBPyConnection) -> None:
    # lowtide is the one writer of these tables and keeps one row per key itself: results by a
    # delete and an anti join per upsert, requests by an anti join, batch members by writing a
    # batch's members once, with the batch row, whose own key refuses a second manifest, units
    # by replacing a run's units whole (a carried unit's input row is not chunked again). Their
    # indexes cost more than they guarded (1M rows in 50,000-row transactions: results 13.8 →
    # 8.5 s of CPU and 96 → 42 MB, batch members 4.2 → 1.3 s and 137 → 28 MB, requests ~6.5 s
    # less), and were held in memory whenever the file took rows.
    rebuild_without_keys(con, UNKEYED)


def rebuild_without_keys(con: duckdb.DuckDBPyConnection, tables: dict[str, dict[str, str]]) -> None:
    """Each table made again without its primary key: every row, column type, NOT NULL and
    named column compression kept."""
    compress = storage_takes_compression(con)
    for table, compression in tables.items():
        columns = con.execute(
            "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
            "WHERE table_catalog = current_database() AND table_schema = 'main' "
            "AND table_name = ? ORDER BY ordinal_position",
            [table],
        ).fetchall()
        ddl = ", ".join(
            f"{name} {kind}"
            + (" NOT NULL" if nullable == "NO" else "")
            + (
                f" USING COMPRESSION {compression[name]}"
                if compress and name in compression
                else ""
            )
            for name, kind, nullable in columns
        )
        con.execute(f"CREATE TABLE {table}_unkeyed ({ddl})")
        con.execute(f"INSERT INTO {table}_unkeyed SELECT * FROM {table}")
        con.execute(f"DROP TABLE {table}")
        con.execute(f"ALTER TABLE {table}_unkeyed RENAME TO {table}")


def cuts_kept_unique_by_lowtide(con: duckdb.DuckDBPyConnection) -> None:
    # a cut is stored only where no cut of its text and budget is (an anti join), and a
    # lookup takes one row per text (the same text under one budget is always cut the same
    # way). The key's index cost more than the cuts: a 1M first night's 295,000 new cuts took
    # 1.1 s of CPU to store with it and 0.2 s without, and 50 MB of the file against 8 MB.
    rebuild_without_keys(con, {"chunk_cuts": {}})
