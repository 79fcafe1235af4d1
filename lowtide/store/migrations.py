"""Numbered, append-only schema migrations for the state file.

Never edit a migration that has shipped: add a new one. `apply(con)` brings any file, empty or
old, to the latest version and records each step in `schema_version`.
"""

from __future__ import annotations

from collections.abc import Callable

import duckdb

from lowtide.errors import StateTooNewError
from lowtide.store import migration_steps as steps

MIGRATIONS: list[tuple[int, str, str | Callable[[duckdb.DuckDBPyConnection], None]]] = [
    (
        1,
        "initial tables",
        """
        CREATE TABLE jobs (
            job VARCHAR PRIMARY KEY,
            view_name VARCHAR NOT NULL,
            id_column VARCHAR NOT NULL,
            output_schema VARCHAR NOT NULL,   -- JSON schema of the output, for the typed view
            job_file VARCHAR,
            updated_at TIMESTAMP NOT NULL
        );
        CREATE TABLE runs (
            run_id VARCHAR PRIMARY KEY,
            job VARCHAR NOT NULL,
            job_fingerprint VARCHAR NOT NULL,
            job_file VARCHAR,
            backend VARCHAR NOT NULL,
            model VARCHAR NOT NULL,
            status VARCHAR NOT NULL,          -- running | submitted | completed | failed
            started_at TIMESTAMP NOT NULL,
            finished_at TIMESTAMP,
            rows BIGINT,
            units BIGINT,
            unique_requests BIGINT,
            cache_hits BIGINT,
            requests_sent BIGINT,
            succeeded BIGINT,
            failed BIGINT,
            eval_accuracy DOUBLE,
            estimate_usd DOUBLE,
            cost_usd DOUBLE,
            realtime_cost_usd DOUBLE,
            published_at TIMESTAMP,
            error VARCHAR
        );
        CREATE TABLE units (
            run_id VARCHAR NOT NULL,
            unit_id VARCHAR NOT NULL,         -- source_id + '#' + chunk number
            source_id VARCHAR NOT NULL,
            kind VARCHAR NOT NULL,            -- row | eval
            chunk_index INTEGER NOT NULL,
            n_chunks INTEGER NOT NULL,
            unit_tokens INTEGER,
            custom_id VARCHAR NOT NULL,
            cache_hit BOOLEAN NOT NULL,
            PRIMARY KEY (run_id, unit_id)
        );
        CREATE TABLE requests (
            custom_id VARCHAR PRIMARY KEY,    -- versioned, derived from request_key
            request_key VARCHAR NOT NULL,     -- custom_id is derived from it: no second index
            job VARCHAR NOT NULL,
            model VARCHAR NOT NULL,
            first_run_id VARCHAR NOT NULL,
            est_input_tokens INTEGER,
            line VARCHAR NOT NULL,            -- the batch JSONL line, exactly as sent
            created_at TIMESTAMP NOT NULL
        );
        CREATE TABLE batches (
            batch_id VARCHAR PRIMARY KEY,     -- lowtide's own id, written before any upload
            run_id VARCHAR NOT NULL,
            shard INTEGER NOT NULL,
            attempt INTEGER NOT NULL,
            backend VARCHAR NOT NULL,
            status VARCHAR NOT NULL,          -- lowtide's batch vocabulary (backends.base.BatchStatus)
            provider_status VARCHAR,
            provider_batch_id VARCHAR,
            input_file_id VARCHAR,
            output_file_id VARCHAR,
            error_file_id VARCHAR,
            n_requests INTEGER NOT NULL,
            n_bytes BIGINT NOT NULL,
            request_counts VARCHAR,
            errors VARCHAR,
            collected BOOLEAN NOT NULL DEFAULT false,
            created_at TIMESTAMP NOT NULL,
            updated_at TIMESTAMP NOT NULL
        );
        CREATE TABLE batch_requests (
            batch_id VARCHAR NOT NULL,
            custom_id VARCHAR NOT NULL,
            PRIMARY KEY (batch_id, custom_id)
        );
        CREATE TABLE results (
            custom_id VARCHAR PRIMARY KEY,
            batch_id VARCHAR,
            run_id VARCHAR NOT NULL,
            outcome VARCHAR NOT NULL,         -- ok | repaired | parse_failed | provider_error | expired | missing
            output VARCHAR,                   -- validated JSON
            raw_text VARCHAR,
            finish_reason VARCHAR,
            error VARCHAR,
            input_tokens BIGINT,
            cached_tokens BIGINT,
            output_tokens BIGINT,
            attempts INTEGER NOT NULL,
            received_at TIMESTAMP NOT NULL
        );
        CREATE TABLE failures (
            run_id VARCHAR NOT NULL,
            source_id VARCHAR NOT NULL,
            kind VARCHAR NOT NULL,
            unit_id VARCHAR,
            reason VARCHAR NOT NULL,
            detail VARCHAR,
            PRIMARY KEY (run_id, source_id, kind)
        );
        CREATE TABLE qa_samples (
            run_id VARCHAR NOT NULL,
            unit_id VARCHAR NOT NULL,
            source_id VARCHAR NOT NULL,
            output VARCHAR,
            verdict VARCHAR,
            correct_value VARCHAR,
            PRIMARY KEY (run_id, unit_id)
        );
        CREATE TABLE eval_scores (
            run_id VARCHAR NOT NULL,
            job VARCHAR NOT NULL,
            field VARCHAR NOT NULL,
            n BIGINT NOT NULL,
            correct BIGINT NOT NULL,
            accuracy DOUBLE,
            schema_valid_rate DOUBLE,
            PRIMARY KEY (run_id, field)
        );
        CREATE TABLE costs (
            run_id VARCHAR NOT NULL,
            level VARCHAR NOT NULL,           -- run | batch
            batch_id VARCHAR NOT NULL,        -- '' for the run level
            backend VARCHAR NOT NULL,
            model VARCHAR NOT NULL,
            requests BIGINT NOT NULL,
            input_tokens BIGINT NOT NULL,
            cached_tokens BIGINT NOT NULL,
            output_tokens BIGINT NOT NULL,
            cost_usd DOUBLE NOT NULL,
            realtime_cost_usd DOUBLE NOT NULL,
            estimate_usd DOUBLE,
            price_date VARCHAR,
            PRIMARY KEY (run_id, level, batch_id)
        );
        CREATE TABLE metrics (
            run_id VARCHAR NOT NULL,
            name VARCHAR NOT NULL,
            value DOUBLE,
            PRIMARY KEY (run_id, name)
        );
        """,
    ),
]

MIGRATIONS.append(
    (
        2,
        "results know how they were obtained; re-asks point at the request they repair",
        """
        ALTER TABLE results ADD COLUMN channel VARCHAR DEFAULT 'batch';   -- batch | realtime
        ALTER TABLE requests ADD COLUMN reask_of VARCHAR;                 -- custom_id repaired
        """,
    )
)

MIGRATIONS.append(
    (
        3,
        "eval gate verdicts; provider-reported usage; per-request cost",
        """
        ALTER TABLE runs ADD COLUMN gate_note VARCHAR;     -- why a run is held, or NULL
        ALTER TABLE batches ADD COLUMN usage VARCHAR;      -- the provider's batch-level usage
        ALTER TABLE results ADD COLUMN cost_usd DOUBLE;    -- this request's price, as billed
        ALTER TABLE costs ADD COLUMN provider_input_tokens BIGINT;   -- batch-level usage, where
        ALTER TABLE costs ADD COLUMN provider_output_tokens BIGINT;  -- the provider reports one
        """,
    )
)


MIGRATIONS.append(
    (
        4,
        "requests keep their own message; the shared prompt is stored once per template",
        steps.messages_kept_apart,
    )
)

MIGRATIONS.append(
    (
        5,
        "one driver per run (a lease), and the input a run was made from",
        """
        ALTER TABLE runs ADD COLUMN input_fingerprint VARCHAR;  -- resume only on the same input
        ALTER TABLE runs ADD COLUMN lease_owner VARCHAR;        -- host:pid:token driving the run
        ALTER TABLE runs ADD COLUMN lease_until TIMESTAMP;
        """,
    )
)

MIGRATIONS.append(
    (
        6,
        "a neutral result location for providers without result files; one meaning of "
        "realtime_cost_usd (the billed tokens at list price) and the naive counterfactual apart",
        """
        ALTER TABLE batches ADD COLUMN result_ref VARCHAR;  -- e.g. Anthropic's batch id
        UPDATE batches SET result_ref = output_file_id, output_file_id = NULL
            WHERE backend = 'anthropic';
        ALTER TABLE runs ADD COLUMN naive_cost_usd DOUBLE;  -- list price, no dedupe, no cache
        UPDATE runs SET naive_cost_usd = realtime_cost_usd,
            realtime_cost_usd = (SELECT c.realtime_cost_usd FROM costs c
                                 WHERE c.run_id = runs.run_id AND c.level = 'run');
        """,
    )
)

MIGRATIONS.append(
    (
        7,
        "how a job's chunk answers combine into its row's answer",
        """
        ALTER TABLE jobs ADD COLUMN reduce VARCHAR;  -- JSON: output field -> rule
        """,
    )
)

MIGRATIONS.append(
    (
        8,
        "every result says which engine gave it (the cache's answer families)",
        """
        ALTER TABLE results ADD COLUMN engine VARCHAR;  -- emulator | <family>:<model>
        UPDATE results SET engine = CASE WHEN runs.backend = 'emulator' THEN 'emulator'
                                         ELSE runs.backend || ':' || runs.model END
            FROM runs WHERE runs.run_id = results.run_id;
        """,
    )
)

MIGRATIONS.append(
    (
        9,
        "a night whose job and input did not change is recorded without asking anything",
        """
        ALTER TABLE runs ADD COLUMN input_digest VARCHAR;   -- digest of the input's bytes
        ALTER TABLE runs ADD COLUMN spec_digest VARCHAR;    -- digest of the whole job spec
        ALTER TABLE runs ADD COLUMN unchanged_from VARCHAR; -- the run whose rows this one shows
        """,
    )
)

MIGRATIONS.append(
    (
        10,
        "a job with [input] cursor_column reads only the rows past its last completed run's mark",
        """
        ALTER TABLE runs ADD COLUMN cursor_column VARCHAR; -- the input column the run read past
        ALTER TABLE runs ADD COLUMN cursor_from VARCHAR;   -- JSON mark it read past; NULL: all
        ALTER TABLE runs ADD COLUMN cursor_high VARCHAR;   -- JSON mark for the next run
        """,
    )
)

MIGRATIONS.append(
    (
        11,
        "a [route] runs one step per engine; a step whose time is up is switched away from",
        """
        ALTER TABLE runs ADD COLUMN route_id VARCHAR;        -- the route's first step's run id
        ALTER TABLE runs ADD COLUMN route_step INTEGER;      -- 0 for the first engine
        ALTER TABLE runs ADD COLUMN step_ends_at TIMESTAMP;  -- when the step gives way; NULL: last
        ALTER TABLE runs ADD COLUMN switched_at TIMESTAMP;   -- when its remainder went on
        """,
    )
)

MIGRATIONS.append(
    (
        12,
        "a batch knows when its requests reached the provider (what requests_sent counts)",
        """
        ALTER TABLE batches ADD COLUMN sent_at TIMESTAMP;  -- accepted by the provider, or begun
        UPDATE batches SET sent_at = updated_at
        WHERE provider_batch_id IS NOT NULL OR status NOT IN ('pending', 'uploaded', 'failed')
              AND NOT (status = 'cancelled' AND provider_batch_id IS NULL);
        """,
    )
)

MIGRATIONS.append(
    (
        13,
        "where a long text was cut into chunks, remembered per text and budget (chunk once)",
        """
        CREATE TABLE chunk_cuts (
            text_md5 VARCHAR NOT NULL,        -- md5 of the row's text
            budget VARCHAR NOT NULL,          -- recipe, tokenizer version, encoding, budget
            starts INTEGER[] NOT NULL,        -- each piece's first character
            lengths INTEGER[] NOT NULL,       -- each piece's length in characters
            tokens INTEGER[] NOT NULL,        -- each piece's token count
            PRIMARY KEY (text_md5, budget)
        );
        """,
    )
)


MIGRATIONS.append(
    (
        14,
        "a job's input rows stored once, with which runs read them (not a copy per run)",
        steps.store_sources_once,
    )
)

MIGRATIONS.append(
    (
        15,
        "a night's unchanged rows keep the units of the run the view showed (not chunked again)",
        """
        ALTER TABLE runs ADD COLUMN carried_from VARCHAR;  -- the run whose units it copied
        ALTER TABLE runs ADD COLUMN rows_carried BIGINT;   -- input rows that kept those units
        ALTER TABLE runs ADD COLUMN units_recipe VARCHAR;  -- column types, cut and custom_id recipes
        """,
    )
)


MIGRATIONS.append(
    (
        16,
        "results, requests, batch members and units without a primary key: lowtide keeps one "
        "row per key itself",
        steps.keyed_by_lowtide,
    )
)


MIGRATIONS.append(
    (
        17,
        "a request's message may live in its run's messages file beside the state file",
        # the file (in `LinesStore.messages_dir`) that holds the request's message; NULL:
        # the message is `user_message`, or the request carries a whole `line`
        "ALTER TABLE requests ADD COLUMN message_file VARCHAR;",
    )
)


MIGRATIONS.append(
    (
        18,
        "remembered cuts are found by a key of their text: XXH3-128 for new ones, md5 for those "
        "remembered before",
        # a cut keyed by md5 is found by it until a night meets its text again and keys it anew
        # (`tasks.chunk.long_text_cuts`)
        "ALTER TABLE chunk_cuts RENAME COLUMN text_md5 TO text_key;",
    )
)


MIGRATIONS.append(
    (
        19,
        "remembered cuts without a primary key: lowtide keeps one cut per text and budget",
        steps.cuts_kept_unique_by_lowtide,
    )
)

MIGRATIONS.append(
    (
        20,
        "provider queues: each batch's estimated prompt tokens, the limits lowtide was told or "
        "learned per provider and model, and every batch a provider refused for its quota",
        # `est_tokens`: what the batch puts in the provider's queue (OpenAI counts enqueued
        # prompt tokens); NULL for batches planned before this version (counted as 0)
        "ALTER TABLE batches ADD COLUMN est_tokens BIGINT;"
        # one row per provider, model ('*': all models) and limit name; `value` is the limit,
        # or for `not_before` the epoch second before which no batch may be created
        "CREATE TABLE provider_limits ("
        " provider VARCHAR NOT NULL, model VARCHAR NOT NULL, name VARCHAR NOT NULL,"
        " value DOUBLE NOT NULL, source VARCHAR NOT NULL, updated_at TIMESTAMP NOT NULL,"
        " PRIMARY KEY (provider, model, name));"
        # a refused provider batch executed nothing; its lowtide batch is sent again, and crash
        # repair never adopts the refused id (`claimed_provider_ids`)
        "CREATE TABLE quota_refusals ("
        " batch_id VARCHAR NOT NULL, run_id VARCHAR NOT NULL, provider VARCHAR NOT NULL,"
        " model VARCHAR NOT NULL, provider_batch_id VARCHAR, reason VARCHAR NOT NULL,"
        " refused_at TIMESTAMP NOT NULL, queued_tokens BIGINT NOT NULL DEFAULT 0);",
        # `queued_tokens`: what else the queue held (lowtide's count) when it refused; the
        # batch is not sent again before the queue holds less
    )
)


MIGRATIONS.append(
    (
        21,
        "what a batch left at its provider: each file's (or Anthropic batch's) size, and "
        "whether lowtide deleted it",
        """
        CREATE TABLE provider_items (
            provider_id VARCHAR PRIMARY KEY,  -- file-... (OpenAI), msgbatch_... (Anthropic)
            batch_id VARCHAR NOT NULL,        -- the lowtide batch it belongs to
            role VARCHAR NOT NULL,            -- input | output | error | batch (ItemRole)
            bytes BIGINT,                     -- its size as the provider reported it, if it did
            kept BOOLEAN NOT NULL,            -- the job keeps it ([provider] keep_files)
            deleted_at TIMESTAMP,             -- when lowtide deleted it
            gone_at TIMESTAMP,                -- when lowtide found it gone without deleting it
            delete_error VARCHAR,             -- why lowtide's last delete of it failed
            recorded_at TIMESTAMP NOT NULL
        );
        -- when lowtide dealt with what the provider keeps of the batch, after its results
        -- were stored: deleted it, or kept it for the job; NULL: not yet
        ALTER TABLE batches ADD COLUMN released_at TIMESTAMP;
        """,
    )
)

LATEST = MIGRATIONS[-1][0]


def current_version(con: duckdb.DuckDBPyConnection) -> int:
    con.execute(
        "CREATE TABLE IF NOT EXISTS schema_version "
        "(version INTEGER PRIMARY KEY, description VARCHAR, applied_at TIMESTAMP)"
    )
    rows = con.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchall()
    return int(rows[0][0])


def apply(con: duckdb.DuckDBPyConnection) -> int:
    """Apply every migration newer than the file's version, each in its own transaction."""
    version = current_version(con)
    if version > LATEST:
        raise StateTooNewError(
            f"state file is at schema version {version}, newer than this lowtide ({LATEST}); "
            "upgrade lowtide"
        )
    for number, description, sql in MIGRATIONS:
        if number <= version:
            continue
        con.execute("BEGIN")
        if callable(sql):  # a step that depends on what the file holds (e.g. each job's tables)
            sql(con)
        else:
            con.execute(sql)
        con.execute("INSERT INTO schema_version VALUES (?, ?, now())", [number, description])
        con.execute("COMMIT")
        version = number
    return version
