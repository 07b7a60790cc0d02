#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("'score' is not implemented yet")
}
