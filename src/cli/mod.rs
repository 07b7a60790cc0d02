pub mod bench;
pub mod check;
pub mod collective_check;
pub mod common;
pub mod demo;
pub mod generate;
pub mod make_model;
pub mod score;
