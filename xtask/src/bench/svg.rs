//! The scale curve as hand-written SVG.

use super::report::ScalePoint;

/// What one panel of the scale curve plots.
type PanelValue = fn(&ScalePoint) -> Option<f64>;

/// The scale curve: time and peak heap per connection against connections (log scale),
/// two panels of hand-written SVG.
pub(super) fn render_svg(points: &[ScalePoint]) -> String {
    const W: f64 = 360.0;
    const H: f64 = 240.0;
    const PAD: f64 = 50.0;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n",
        2.0 * W,
        H + 30.0
    );
    svg.push_str("<text x=\"10\" y=\"16\" font-size=\"13\">SimFabric, 10% RTU loss: cost per connection vs connections</text>\n");
    let panels: [(&str, &str, PanelValue); 2] = [
        ("time per connection", "µs", |p| {
            p.ns_per_conn.map(|v| v / 1e3)
        }),
        ("peak heap per connection", "bytes", |p| p.bytes_per_conn),
    ];
    let (min_n, max_n) = (
        points
            .iter()
            .map(|p| p.connections)
            .min()
            .unwrap_or(1)
            .max(1) as f64,
        points
            .iter()
            .map(|p| p.connections)
            .max()
            .unwrap_or(1)
            .max(1) as f64,
    );
    for (i, (title, unit, value)) in panels.iter().enumerate() {
        let x0 = i as f64 * W + PAD;
        let (plot_w, plot_h, top) = (W - PAD - 20.0, H - PAD - 20.0, 40.0);
        let max_v = points
            .iter()
            .filter_map(value)
            .fold(0.0_f64, f64::max)
            .max(1e-9)
            * 1.15;
        svg.push_str(&format!(
            "<text x=\"{x0}\" y=\"{}\">{title} ({unit})</text>\n<rect x=\"{x0}\" y=\"{top}\" width=\"{plot_w}\" height=\"{plot_h}\" fill=\"none\" stroke=\"#888\"/>\n",
            top - 6.0
        ));
        svg.push_str(&format!("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{max_v:.1}</text>\n<text x=\"{}\" y=\"{}\" text-anchor=\"end\">0</text>\n", x0 - 4.0, top + 10.0, x0 - 4.0, top + plot_h));
        let span = (max_n / min_n).log10().max(1e-9);
        let mut line = Vec::new();
        for p in points {
            let x = x0 + plot_w * ((p.connections as f64 / min_n).log10() / span);
            svg.push_str(&format!(
                "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{}k</text>\n",
                top + plot_h + 14.0,
                p.connections / 1000
            ));
            if let Some(v) = value(p) {
                let y = top + plot_h * (1.0 - v / max_v);
                line.push(format!("{x:.1},{y:.1}"));
                svg.push_str(&format!(
                    "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"#1f77b4\"/>\n<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{v:.1}</text>\n",
                    y - 6.0
                ));
            } else {
                svg.push_str(&format!("<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#999\">not run</text>\n", top + plot_h / 2.0));
            }
        }
        if line.len() > 1 {
            svg.push_str(&format!(
                "<polyline points=\"{}\" fill=\"none\" stroke=\"#1f77b4\"/>\n",
                line.join(" ")
            ));
        }
    }
    svg.push_str("</svg>\n");
    svg
}
