//! Build script: the version every binary and service reports (`--version`,
//! the NATS micro service, `wakebus status`) is the package's version with
//! the commit it was built from as semver build metadata, `0.1.0+g1a2b3c4d5e6f`,
//! so that an operator can tell builds apart. The commit comes from
//! `WAKEBUS_BUILD_COMMIT` when set (an image built without `.git`), else
//! from `git`; without either the version is the package's alone.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=WAKEBUS_BUILD_COMMIT");
    let commit = std::env::var("WAKEBUS_BUILD_COMMIT")
        .ok()
        .filter(|commit| !commit.is_empty())
        .or_else(git_commit);
    let package = std::env::var("CARGO_PKG_VERSION").expect("set by cargo");
    let version = match commit.as_deref().map(metadata) {
        Some(metadata) if !metadata.is_empty() => format!("{package}+g{metadata}"),
        _ => package,
    };
    println!("cargo:rustc-env=WAKEBUS_VERSION={version}");
}

/// The checked-out commit, and the files whose change means another one.
fn git_commit() -> Option<String> {
    let git = |args: &[&str]| {
        let output = Command::new("git").args(args).output().ok()?;
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
    };
    // Only this repository's own checkout: not one it was vendored into.
    let top = git(&["rev-parse", "--show-toplevel"])?;
    let manifest = std::env::var("CARGO_MANIFEST_DIR").ok()?;
    let same = |path: &str| std::fs::canonicalize(path).ok();
    if same(&top)? != same(&manifest)? {
        return None;
    }
    // Only files that exist: cargo runs the script again at every build
    // for one that does not. HEAD's log moves with every commit, checkout
    // and reset; the branch's ref and packed-refs where there is no log.
    let mut watched = vec![
        "HEAD".to_owned(),
        "logs/HEAD".to_owned(),
        "packed-refs".to_owned(),
    ];
    watched.extend(git(&["symbolic-ref", "-q", "HEAD"]));
    for path in watched {
        if let Some(path) = git(&["rev-parse", "--git-path", &path])
            && std::path::Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    git(&["rev-parse", "--short=12", "HEAD"])
}

/// What semver allows in build metadata: ASCII letters, digits and `-`.
fn metadata(commit: &str) -> String {
    commit
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(40)
        .collect()
}
