"""Evidence: digests over document and samples, bundles that re-run from their own files, tampering named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from kvscope.cli import app
from kvscope.verifier.criteria import CriteriaFile, Parity, evaluate, plain_row
from kvscope.verifier.db import Run, VerifierError
from kvscope.verifier.evidence import (
    Verification,
    bundle_digest,
    check_bundle,
    chunks_of,
    digest,
    export_bundle,
    manifest_digest,
    record_verdict,
)
from kvscope.verifier.schema import chunk_digest

runner = CliRunner()
CRITERIA = {
    "runs": ["a", "b"],
    "criteria": [
        {"name": "save", "kind": "parity", "metric": "kv.store.put.bytes", "runs": ["a", "b"], "tolerance": 0.01},
        {"name": "idle", "kind": "zero_delta", "run": "a", "metric": {"name": "kv.tier.allocated.bytes"}},
    ],
}


@pytest.fixture
def bundle(recording, tmp_path):
    recording.add("a", "kv.store.put.bytes", [0, 500, 1000], tier="dram")
    recording.add("b", "kv.store.put.bytes", [0, 400, 1004], tier="dram")
    recording.add("a", "kv.tier.allocated.bytes", [0, 0, 0], kind="gauge", tier="nof")
    spec = CriteriaFile.model_validate(CRITERIA)
    runs = spec.bind(recording.db, ["a", "b"])
    verification = Verification(recording.db, spec, runs, None)
    verdicts = [verification.judge(criterion) for criterion in spec.criteria]
    verification.finish()
    assert [v.passed for v in verdicts] == [True, True]
    return export_bundle(recording.db, [], tmp_path / "bundle")


def rewrite_manifest(bundle, change, recompute_bundle_digest: bool = True) -> None:
    """Edit the first verdict as a forger would: with the verification's manifest and the bundle's own digest
    recomputed over the edit (only a digest given out of band or a signature tells then)."""
    path = bundle / "evidence.json"
    data = json.loads(path.read_text())
    change(data["verdicts"][0])
    if recompute_bundle_digest:
        relist(data)
    path.write_text(json.dumps(data))


def relist(data: dict) -> None:
    """What a forger does last: each verification's manifest lists the bundle's verdicts as they are now (and no
    others), its digest and the bundle's recomputed."""
    for entry in data["verifications"]:
        manifest = entry["manifest"]
        manifest["verdicts"] = [
            {"verdict_id": v["verdict_id"], "criterion": v["document"]["criterion"]["name"],
             "passed": v["document"]["passed"], "digest": v["digest"]}
            for v in data["verdicts"] if v["document"].get("verification_id") == entry["verification_id"]
        ]  # fmt: skip
        manifest["passed"] = all(v["passed"] for v in manifest["verdicts"]) and not manifest["errors"]
        entry["digest"] = manifest_digest(manifest)
    data["bundle_digest"] = bundle_digest(data)


def test_an_untouched_bundle_checks_out(bundle):
    report = check_bundle(bundle)
    assert (report.ok, report.checked, report.problems) == (True, 2, [])
    result = runner.invoke(app, ["evidence", "check", str(bundle)])
    assert result.exit_code == 0 and "2 verdict(s) recomputed" in result.output


def test_the_digest_covers_the_document_and_every_sample_through_the_chunk_hashes(recording, bundle):
    verdict = json.loads((bundle / "evidence.json").read_text())["verdicts"][0]
    document = verdict["document"]
    chunks = chunks_of(recording.db.con, [s["series_id"] for s in document["series"]])
    assert digest(document, chunks) == verdict["digest"]
    assert document["sample_count"] == int(chunks["samples"].sum()) == 6
    (first_id, *_), first_hash = chunks["series_id"], chunks["sha256"][0]
    stored = recording.db.con.execute(f"SELECT ts, value FROM samples WHERE series_id = {first_id} ORDER BY ts")
    ts, values = zip(*stored.fetchall(), strict=True)
    assert chunk_digest(list(ts), list(values)) == first_hash  # the chunk hash is over the samples themselves
    chunks["sha256"][0] = bytes(32)
    assert digest(document, chunks) != verdict["digest"]
    assert "increase" in document["sql"] and document["duckdb_version"] == duckdb.__version__


def test_an_edited_sample_is_caught_by_digest_and_by_the_rerun(bundle):
    parquet = bundle / "samples.parquet"
    with duckdb.connect() as con:
        con.execute(
            f"COPY (SELECT series_id, ts, CASE WHEN value = 1004 THEN 2000 ELSE value END AS value "
            f"FROM read_parquet('{parquet}')) TO '{bundle}/edited.parquet' (FORMAT parquet)"
        ).fetchall()
    (bundle / "edited.parquet").replace(parquet)
    problems = check_bundle(bundle).problems
    assert any(p.startswith("verdict 1 (save): series") and "the samples were changed" in p for p in problems)
    assert any("verdict 1 (save): recorded pass, the samples say otherwise" in p for p in problems)
    result = runner.invoke(app, ["evidence", "check", str(bundle)])
    assert result.exit_code == 1 and "tampered" in result.output


def test_an_edited_verdict_is_caught_even_when_its_digest_is_recomputed(recording, bundle):
    """A forger who flips the verdict and the numbers, then re-digests, still loses to the re-run SQL."""

    def forge(verdict: dict) -> None:
        document = verdict["document"]
        document["observed"][0]["b_value"] = 1000
        verdict["digest"] = digest(document, chunks_of(recording.db.con, [s["series_id"] for s in document["series"]]))

    rewrite_manifest(bundle, forge)
    assert check_bundle(bundle).problems == [
        "verdict 1 (save): re-running its SQL gives different rows than the evidence records"
    ]


@pytest.mark.parametrize(
    "edit",
    [
        lambda v: v["document"].__setitem__("sql", v["document"]["sql"].replace("0.01", "0.5")),
        lambda v: v["document"]["threshold"].__setitem__("relative_tolerance", 0.5),
        lambda v: v["document"]["series"][0]["labels"].__setitem__("tier", "nof"),
    ],
    ids=["sql", "threshold", "labels"],
)
def test_any_edit_of_the_document_breaks_its_digest(bundle, edit):
    rewrite_manifest(bundle, edit)
    assert any("digest mismatch" in p for p in check_bundle(bundle).problems)


@pytest.mark.parametrize("name", ["samples.parquet", "chunks.parquet", "evidence.json"])
def test_a_bundle_missing_a_file_is_not_a_bundle(bundle, name):
    (bundle / name).unlink()
    with pytest.raises(VerifierError, match=f"{name} is missing"):
        check_bundle(bundle)


def test_a_deleted_sample_is_caught_by_the_chunk_counts(bundle):
    parquet = bundle / "samples.parquet"
    with duckdb.connect() as con:
        con.execute(
            f"COPY (SELECT * FROM read_parquet('{parquet}') WHERE value <> 400) TO '{bundle}/less.parquet' "
            "(FORMAT parquet)"
        ).fetchall()
    (bundle / "less.parquet").replace(parquet)
    assert any("the samples were changed" in p for p in check_bundle(bundle).problems)


def test_recording_the_same_verdict_twice_gives_the_same_digest(recording, bundle):
    spec = CriteriaFile.model_validate(CRITERIA)
    runs = spec.bind(recording.db, ["a", "b"])
    first = json.loads((bundle / "evidence.json").read_text())["verdicts"][0]
    outcome = evaluate(recording.db, spec.criteria[0], runs)
    again = record_verdict(recording.db, outcome, runs, first["document"]["verification_id"])
    assert again.digest == first["digest"] and again.verdict_id == 3


@pytest.mark.parametrize(
    "sql",
    [
        "COPY (SELECT true AS passed) TO '{out}'",
        "ATTACH '{out}' AS planted; SELECT true AS passed",
        "SELECT count(*) > 0 AS passed FROM read_csv('/etc/hostname')",
        "SET enable_external_access = true; COPY (SELECT 1) TO '{out}'",
    ],
    ids=["copy-to", "attach", "read-file", "unlock"],
)
def test_a_bundles_sql_cannot_touch_the_file_system(bundle, tmp_path, sql):
    """`evidence check` runs SQL a bundle's author wrote: in a database without file access, whose settings are
    locked. The forged SQL fails to run and is reported; nothing is written or read."""
    out = tmp_path / "planted"
    rewrite_manifest(bundle, lambda v: v["document"].__setitem__("sql", sql.format(out=out)))
    problems = check_bundle(bundle).problems
    assert any("verdict 1 (save): its SQL no longer runs on the bundle" in problem for problem in problems), problems
    assert not out.exists() and not out.with_suffix(".wal").exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: (b / "evidence.json").write_text('{"verdicts": []}'), "no verdicts to check"),
        (lambda b: (b / "evidence.json").write_text('{"verdicts": [{"digest": "x"}]}'), "document is incomplete"),
        (lambda b: (b / "samples.parquet").write_bytes(b"PAR1 not a parquet file"), "cannot be read"),
        (lambda b: rewrite_manifest(b, lambda v: v["document"].pop("series")), "document is incomplete"),
    ],
    ids=["no-verdicts", "no-document", "garbage-parquet", "no-series"],
)
def test_a_malformed_bundle_is_an_input_error_that_says_what_is_wrong(bundle, damage, message):
    damage(bundle)
    with pytest.raises(VerifierError, match=message):
        check_bundle(bundle)
    result = runner.invoke(app, ["evidence", "check", str(bundle)])
    assert result.exit_code == 2 and message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_sql_without_a_passed_column_judges_nothing_and_is_reported(bundle):
    rewrite_manifest(bundle, lambda v: v["document"].__setitem__("sql", "SELECT 1 AS one"))
    assert "verdict 1 (save): its SQL returns no passed column, so it judges nothing" in check_bundle(bundle).problems


def test_the_zip_the_service_serves_checks_out_and_a_zip_without_the_bundle_is_refused(bundle, tmp_path):
    import shutil
    import zipfile

    archive = Path(shutil.make_archive(str(tmp_path / "served"), "zip", root_dir=bundle))  # as the service zips it
    report = check_bundle(archive)
    assert (report.ok, report.checked) == (True, 2)
    result = runner.invoke(app, ["evidence", "check", str(archive)])
    assert result.exit_code == 0 and "2 verdict(s) recomputed" in result.output
    hostile = tmp_path / "hostile.zip"
    with zipfile.ZipFile(hostile, "w") as zipped:
        zipped.writestr("../../evidence.json", "{}")  # a member path out of the folder is never written
    result = runner.invoke(app, ["evidence", "check", str(hostile)])
    assert result.exit_code == 2 and "evidence.json is missing from the zip" in " ".join(result.output.split())
    assert not (tmp_path.parent / "evidence.json").exists()
    (tmp_path / "garbage.zip").write_bytes(b"PK not a zip")
    result = runner.invoke(app, ["evidence", "check", str(tmp_path / "garbage.zip")])
    assert result.exit_code == 2 and "not a readable zip" in " ".join(result.output.split())


def _redigest(recording, verdict: dict) -> None:
    """What a forger does after an edit: the verdict's digest recomputed over the edited document."""
    document = verdict["document"]
    verdict["digest"] = digest(document, chunks_of(recording.db.con, [s["series_id"] for s in document["series"]]))


def test_sql_replaced_by_a_constant_pass_is_caught_by_recompiling_the_criterion(recording, bundle):
    """`SELECT true AS passed` with the rows it 'returns' and every digest recomputed: the criterion (tolerance
    0.01) compiles to other SQL."""

    def forge(verdict: dict) -> None:
        document = verdict["document"]
        document["sql"], document["columns"], document["observed"] = (
            "SELECT true AS passed",
            ["passed"],
            [{"passed": True}],
        )
        _redigest(recording, verdict)

    rewrite_manifest(bundle, forge)
    assert check_bundle(bundle).problems == [
        "verdict 1 (save): its SQL is not what its criterion compiles to: the SQL or the criterion was changed"
    ]


def test_an_edit_without_the_bundle_digest_recomputed_is_caught(bundle):
    """The verdict ids, the database and the export time are covered by the bundle's digest too."""
    rewrite_manifest(bundle, lambda verdict: verdict.__setitem__("verdict_id", 7), recompute_bundle_digest=False)
    assert check_bundle(bundle).problems == [
        "evidence.json: its bundle_digest does not match its content: the bundle was edited after export",
        "verdict 7: not what verification 1's manifest lists",
    ]


def _recompile(recording, verdict: dict) -> None:
    """A thorough forger: the SQL compiled again from the edited document, its rows re-run, the digest redone."""
    document = verdict["document"]
    runs = {role: Run(run["run_id"], run["name"], run["arm"], run["scenario"], "ab", 0.0, None, {})
            for role, run in document["runs"].items()}  # fmt: skip
    document["sql"] = Parity.model_validate(document["criterion"]).sql(runs)
    result = recording.db.con.execute(document["sql"])
    columns = [column[0] for column in result.description]
    document["observed"] = [plain_row(dict(zip(columns, row, strict=True))) for row in result.fetchall()]
    _redigest(recording, verdict)


def _loosen_and_drop(recording, bundle) -> None:
    """The forgeries a bundle's own hashes cannot tell: a tolerance loosened with its SQL compiled again, and the
    other verdict deleted; every digest recomputed."""
    path = bundle / "evidence.json"
    data = json.loads(path.read_text())
    verdict = data["verdicts"][0]
    document = verdict["document"]
    document["criterion"]["tolerance"] = 0.5
    document["threshold"]["relative_tolerance"] = 0.5
    _recompile(recording, verdict)
    data["verdicts"] = [verdict]
    relist(data)
    path.write_text(json.dumps(data))


@pytest.fixture
def keys(tmp_path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private, public = tmp_path / "key.pem", tmp_path / "key.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))  # fmt: skip
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip
    return private, public


def test_a_digest_given_out_of_band_catches_what_the_bundle_cannot(recording, bundle):
    given = check_bundle(bundle).digest
    assert check_bundle(bundle, expect_digest=given).ok
    _loosen_and_drop(recording, bundle)
    assert check_bundle(bundle).ok  # consistent in itself: the SQL is what the loosened criterion compiles to
    report = check_bundle(bundle, expect_digest=given)
    assert report.problems == [f"evidence.json: digest {report.digest}, not the expected {given}"]
    result = runner.invoke(app, ["evidence", "check", str(bundle), "--expect-digest", given])
    assert result.exit_code == 1 and "not the expected" in " ".join(result.output.split())


def test_a_signed_bundle_checks_with_the_public_key_and_an_edited_one_does_not(recording, bundle, keys):
    private, public = keys
    signed = runner.invoke(app, ["evidence", "sign", str(bundle), "--key", str(private)])
    assert signed.exit_code == 0, signed.output
    checked = runner.invoke(app, ["evidence", "check", str(bundle), "--public-key", str(public)])
    assert checked.exit_code == 0 and "signature verified" in checked.output, checked.output
    _loosen_and_drop(recording, bundle)
    report = check_bundle(bundle, public_key=public)
    assert not report.signed and report.problems == [
        f"evidence.sig: not this key's signature of digest {report.digest}"
    ]
    (bundle / "evidence.sig").unlink()
    assert check_bundle(bundle, public_key=public).problems == ["evidence.sig: missing: the bundle is not signed"]


def test_signing_refuses_a_bundle_edited_after_export_and_a_key_that_is_not_ed25519(bundle, keys, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ec_key = tmp_path / "ec.pem"
    ec_key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
    result = runner.invoke(app, ["evidence", "sign", str(bundle), "--key", str(ec_key)])
    assert result.exit_code == 2 and "not an Ed25519 key" in " ".join(result.output.split())
    rewrite_manifest(bundle, lambda verdict: verdict.__setitem__("verdict_id", 7), recompute_bundle_digest=False)
    result = runner.invoke(app, ["evidence", "sign", str(bundle), "--key", str(keys[0])])
    assert result.exit_code == 2 and "does not match its content" in " ".join(result.output.split())


def test_a_bundles_rerun_script_re_runs_every_verdict_with_plain_duckdb(bundle, monkeypatch):
    """rerun.sql, run by DuckDB alone from the bundle's folder (no kvscope), builds the tables from the bundle and
    gives each verdict's recorded `passed` beside the one its SQL computes now; after that it reads no file."""
    monkeypatch.chdir(bundle)
    con = duckdb.connect()
    statements = [s for s in (bundle / "rerun.sql").read_text().split(";\n") if s.strip()]
    for statement in statements[:-2]:
        con.execute(statement)
    rows = [con.execute(statement).fetchone() for statement in statements[-2:]]
    names = [v["document"]["criterion"]["name"] for v in json.loads((bundle / "evidence.json").read_text())["verdicts"]]
    assert [row[1] for row in rows] == names
    assert all(row[2] is True and row[3] is True for row in rows), rows
    with pytest.raises(duckdb.Error, match="disabled"):
        con.execute("SELECT * FROM read_parquet('samples.parquet')")


def test_the_bundle_readme_says_how_to_re_hash_it_and_its_command_works(bundle):
    """README.md's re-hash command, run as it is written from the bundle's folder, says True."""
    readme = (bundle / "README.md").read_text()
    command = readme.split('`python -c "', 1)[1].split('"`', 1)[0]
    done = subprocess.run([sys.executable, "-c", command], cwd=bundle, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


def _two_verdicts_one_failing(recording) -> int:
    """A verification whose second verdict fails (b saved 10% more); returns the passing verdict's id."""
    recording.add("a", "kv.store.put.bytes", [0, 1000], tier="dram")
    recording.add("b", "kv.store.put.bytes", [0, 1100], tier="dram")
    spec = CriteriaFile.model_validate(
        {"runs": ["a", "b"], "arms": {"a": "a", "b": "b"}, "criteria": [
            {"name": "loose", "kind": "parity", "metric": "kv.store.put.bytes", "runs": ["a", "b"], "tolerance": 0.5},
            {"name": "tight", "kind": "parity", "metric": "kv.store.put.bytes", "runs": ["a", "b"], "tolerance": 0.01},
        ]}
    )  # fmt: skip
    verification = Verification(recording.db, spec, spec.bind(recording.db, ["a", "b"]), None)
    passing, failing = (verification.judge(criterion) for criterion in spec.criteria)
    assert passing.passed and not failing.passed
    assert not verification.finish()["passed"]
    return passing.verdict_id


def test_a_bundle_of_the_passing_verdicts_alone_still_shows_the_failing_one(recording, tmp_path):
    """The export of one verdict (as the service serves it) carries its verification's manifest: the check passes,
    and says which verdict of the same verification the bundle leaves out, and that it failed."""
    passing = _two_verdicts_one_failing(recording)
    bundle = export_bundle(recording.db, [passing], tmp_path / "one")
    report = check_bundle(bundle)
    assert report.ok and [v["passed"] for v in report.verifications] == [False]
    assert [(e["criterion"], e["passed"]) for e in report.left_out] == [("tight", False)]
    result = runner.invoke(app, ["evidence", "check", str(bundle)])
    output = " ".join(result.output.split())
    assert result.exit_code == 0 and "FAILED, 2 verdict(s)" in output
    assert "left out of this bundle: verdict 2 tight FAIL (verification 1)" in output


def test_a_verdict_without_its_verifications_manifest_is_refused(recording, tmp_path):
    """A forger who deletes the manifest that lists the failing verdict (every digest recomputed) leaves a verdict
    whose verification the bundle cannot show."""
    bundle = export_bundle(recording.db, [_two_verdicts_one_failing(recording)], tmp_path / "one")
    path = bundle / "evidence.json"
    data = json.loads(path.read_text())
    data["verifications"] = []
    data["bundle_digest"] = bundle_digest(data)
    path.write_text(json.dumps(data))
    assert check_bundle(bundle).problems == [
        "verdict 1: the bundle carries no manifest of the verification that judged it, so nothing shows what else "
        "it judged"
    ]


def test_two_runs_names_swapped_are_caught_by_the_sql_the_arms_or_else_by_the_anchor(recording, tmp_path):
    """A forger swaps the two runs' names (and arms) in every document and in the manifest, every digest recomputed:
    the SQL names the runs, and their arms no longer match the roles the criteria bind them to. One who swaps the
    names alone and compiles the SQL again leaves a bundle consistent in itself, which only the anchor tells."""
    _two_verdicts_one_failing(recording)
    bundle = export_bundle(recording.db, [], tmp_path / "all")
    given = check_bundle(bundle).digest
    path = bundle / "evidence.json"

    def swap(fields: tuple[str, ...], thorough: bool) -> None:
        data = json.loads(path.read_text())
        for runs in [v["document"]["runs"] for v in data["verdicts"]] + [e["manifest"]["runs"] for e in
                                                                             data["verifications"]]:  # fmt: skip
            for field in fields:
                runs["a"][field], runs["b"][field] = runs["b"][field], runs["a"][field]
        for verdict in data["verdicts"]:
            (_recompile if thorough else _redigest)(recording, verdict)
        relist(data)
        path.write_text(json.dumps(data))

    swap(("name", "arm"), thorough=False)
    problems = check_bundle(bundle).problems
    assert "verification 1: role a is bound to run 'b' of arm 'b', and its criteria need arm 'a'" in problems
    assert "verdict 1 (loose): its SQL is not what its criterion compiles to: the SQL or the criterion was changed" in (
        problems
    )
    swap(("arm",), thorough=True)  # the arms back where the criteria want them, the names still swapped
    assert check_bundle(bundle).ok
    report = check_bundle(bundle, expect_digest=given)
    assert report.problems == [f"evidence.json: digest {report.digest}, not the expected {given}"]


def test_a_verdicts_digest_re_hashes_with_rfc8785_and_the_chunk_framing_alone(bundle):
    """What the module docstring says an outsider computes: sha256 over the document's RFC 8785 JSON, a newline,
    then each chunk (series_id int64, first_ts and last_ts float64, samples int64, its sha256) from
    chunks.parquet."""
    import hashlib
    import struct

    import rfc8785

    verdict = json.loads((bundle / "evidence.json").read_text())["verdicts"][0]
    ids = ", ".join(str(s["series_id"]) for s in verdict["document"]["series"])
    with duckdb.connect() as con:
        chunks = con.execute(
            f"SELECT series_id, first_ts, last_ts, samples, sha256 FROM read_parquet('{bundle / 'chunks.parquet'}') "
            f"WHERE series_id IN ({ids}) ORDER BY series_id, first_ts"
        ).fetchall()
    sha = hashlib.sha256(rfc8785.dumps(verdict["document"]) + b"\n")
    for series_id, first_ts, last_ts, samples, chunk_sha in chunks:
        sha.update(struct.pack("<qddq", series_id, first_ts, last_ts, samples) + chunk_sha)
    assert sha.hexdigest() == verdict["digest"]


def test_a_document_of_the_first_format_is_digested_as_it_was(recording, bundle):
    """Verdicts stored before RFC 8785 (format kvscope-evidence/1) were digested over kvscope's sorted-key JSON: such
    a document still checks out, and its digest is that one."""
    import hashlib
    import struct

    from kvscope.verifier.db import canonical_json

    def first_format(verdict: dict) -> None:
        document = verdict["document"]
        document["format"] = "kvscope-evidence/1"
        chunks = chunks_of(recording.db.con, [s["series_id"] for s in document["series"]])
        legacy = hashlib.sha256(canonical_json(document).encode() + b"\n")
        columns = [chunks[c].tolist() for c in ("series_id", "first_ts", "last_ts", "samples", "sha256")]
        for series_id, first_ts, last_ts, samples, chunk_sha in zip(*columns, strict=True):
            legacy.update(struct.pack("<qddq", series_id, first_ts, last_ts, samples) + chunk_sha)
        verdict["digest"] = legacy.hexdigest()
        assert digest(document, chunks) == verdict["digest"]

    rewrite_manifest(bundle, first_format)
    assert check_bundle(bundle).ok

    def before_manifests(verdict: dict) -> None:  # such documents name no verification either
        del verdict["document"]["verification_id"]
        first_format(verdict)

    rewrite_manifest(bundle, before_manifests)
    assert check_bundle(bundle).ok
