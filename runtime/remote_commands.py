"""`precast push` and `precast pull`: bundles to and from OCI registries (registered on the group in
runtime/cli.py). The work is runtime/oci/'s, imported only when one of these commands runs, so the
`remote` extra (requests) is needed only here; without it, one line naming the extra.
"""
from __future__ import annotations

import json
import re

import click

from .cli_support import CA_HELP, PLAIN_HELP, run_cli
from .errors import UserError

REF_HELP = "oci://HOST[:PORT]/REPO:TAG (or @sha256:DIGEST)"


def _registry(ref_text: str, ca, plain_http):
    from .oci import need_remote
    need_remote()
    from .oci.client import Registry
    from .oci.ref import parse_ref
    ref = parse_ref(ref_text)
    return ref, Registry.for_ref(ref, ca=ca, plain_http=plain_http)


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+)\s*([KMG]?)i?B?\s*", text or "", re.I)
    if not m or int(m.group(1)) == 0:
        raise UserError(f"--chunk-size {text!r}: expected a size such as 64M, 512K or 1G")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


@click.command("push")
@click.argument("bundle", type=click.Path())
@click.argument("ref", metavar="REF")
@click.option("--ca", default=None, type=click.Path(), help=CA_HELP)
@click.option("--plain-http", is_flag=True, help=PLAIN_HELP)
@click.option("--chunk-size", default="64M", show_default=True,
              help="Blobs larger than this go up in chunks of this size (each resumable after a lost connection).")
@click.option("--jobs", default=4, show_default=True, type=click.IntRange(1, 32), help="Blobs uploaded at once.")
@click.option("--json", "as_json", is_flag=True, help="Print what was uploaded as JSON (errors too).")
def push_cmd(bundle, ref, ca, plain_http, chunk_size, jobs, as_json):
    """Verify BUNDLE and push it to REF (oci://HOST/REPO:TAG): each file one blob (skipped when the registry
    has it), then one OCI manifest annotated so a pull can choose a machine's engines from it alone."""
    def go():
        chunk = _bytes(chunk_size)
        from .oci.push import push_bundle
        r, registry = _registry(ref, ca, plain_http)
        res = push_bundle(bundle, r, registry, chunk=chunk, workers=jobs, progress=not as_json)
        if as_json:
            click.echo(json.dumps(res.as_dict(), indent=2))
        else:
            chunks = f", {res.chunked} in chunks" if res.chunked else ""
            click.echo(f"pushed {bundle} -> {r}@{res.digest}: {res.uploaded} of {res.blobs} blobs uploaded "
                       f"({_mb(res.bytes_uploaded)}{chunks}); {res.blobs - res.uploaded} already there, in {res.seconds:.1f} s")
    run_cli(go, as_json)


@click.command("pull")
@click.argument("ref", metavar="REF")
@click.option("--out", required=True, type=click.Path(), help="Folder to write the bundle to (replaced whole at the end).")
@click.option("--all", "everything", is_flag=True, help="Every file of the bundle, for every machine.")
@click.option("--for", "fingerprints", multiple=True, metavar="FINGERPRINT",
              help="Prepare for a device with this fingerprint (backend/version/vendor-type/arch[/driver>=X], as "
                   "`precast doctor --json` shows a device's): the artifacts serving it. Repeatable.")
@click.option("--with-onnx", is_flag=True, help="Also the bundle's ONNX of every component (the fallback when an "
                                                "engine cannot load).")
@click.option("--ca", default=None, type=click.Path(), help=CA_HELP)
@click.option("--plain-http", is_flag=True, help=PLAIN_HELP)
@click.option("--jobs", default=4, show_default=True, type=click.IntRange(1, 32), help="Blobs downloaded at once.")
@click.option("--sysroot", default="/", help="Choose for the machine recorded in this tree (as doctor --sysroot).")
@click.option("--json", "as_json", is_flag=True, help="Print what was pulled as JSON (errors too).")
def pull_cmd(ref, out, everything, fingerprints, with_onnx, ca, plain_http, jobs, sysroot, as_json):
    """Pull from REF what this machine selects (as `precast doctor` would) into an ordinary bundle at --out:
    the chosen engines, what every bundle needs, and the ONNX only where nothing else serves a component."""
    def go():
        if everything and fingerprints:
            raise UserError("--all and --for: give one (--all pulls every artifact already)")
        r, registry = _registry(ref, ca, plain_http)
        from .oci.pull import pull_bundle
        machine = None
        if not (everything or fingerprints):
            from .api import machine as this_machine
            from .assign import COMPONENT_MODULE
            machine = this_machine(sysroot, None, None, False,
                                   tuple(dict.fromkeys(("te", "diffusion", "vae", *COMPONENT_MODULE.values()))))
        res = pull_bundle(r, out, registry, machine=machine, fingerprints=tuple(fingerprints), everything=everything,
                          with_onnx=with_onnx, workers=jobs, progress=not as_json)
        if as_json:
            click.echo(json.dumps(res.as_dict(), indent=2))
            return
        for note in res.notes:
            click.echo(f"note: {note}", err=True)
        onnx = f" + the ONNX of {', '.join(res.onnx)}" if res.onnx else ""
        click.echo(f"pulled {r} -> {out}: {len(res.artifacts)} artifacts{onnx}; {res.files} files "
                   f"({_mb(res.bytes_total)}: {_mb(res.bytes_downloaded)} downloaded, {res.reused} files already "
                   f"here); left out {res.left_out} files ({_mb(res.bytes_left_out)}), in {res.seconds:.1f} s")
    run_cli(go, as_json)
