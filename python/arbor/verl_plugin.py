"""Imported by verl in every process that imports verl (its `verl.plugins` entry point, or
`VERL_USE_EXTERNAL_MODULES=arbor.verl_plugin`): registers `arbor` as a rollout name, so
that `actor_rollout_ref.rollout.name=arbor` works in the driver and in every Ray worker
without code of the user's own. The binaries are found as `arbor.verl.ArborProcess` finds
them (`$ARBOR_BIN`, `$ARBOR_LAUNCH_BIN`, `PATH`)."""

from arbor.verl import register

register()
