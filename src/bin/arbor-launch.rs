fn main() {
    std::process::exit(arbor_launch::main());
}
