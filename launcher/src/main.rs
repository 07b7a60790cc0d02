fn main() {
    eprintln!("arbor-launch: not built yet");
    std::process::exit(2);
}
