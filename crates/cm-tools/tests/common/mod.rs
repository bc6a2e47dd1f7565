//! What the ladder tests share.

/// Renders `drawn` (an SVG document) with resvg, saves it as `name` under the test's
/// target folder, and answers how many dark pixels were painted (the white background
/// is not: a broken picture paints little or nothing).
pub(crate) fn render_png(drawn: &str, name: &str) -> usize {
    let mut options = resvg::usvg::Options::default();
    options.fontdb_mut().load_system_fonts();
    let tree = resvg::usvg::Tree::from_str(drawn, &options).expect("resvg reads the SVG");
    let size = tree.size().to_int_size();
    let mut pixmap = resvg::tiny_skia::Pixmap::new(size.width(), size.height()).expect("a canvas");
    resvg::render(&tree, Default::default(), &mut pixmap.as_mut());
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    pixmap.save_png(&path).expect("the PNG is written");
    pixmap
        .pixels()
        .iter()
        .filter(|p| p.red() < 128 && p.alpha() > 0)
        .count()
}
