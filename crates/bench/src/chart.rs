//! `--timeline-svg`: the timeline as an SVG chart.
//!
//! Two panels over the run's seconds: above, the job's throughput and the caches'
//! write-back rate (both MB/s, so a flat write-back line under a flat throughput line is
//! what technique 3 looks like); below, the dirty data.

use plotters::prelude::*;

/// One timeline row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row {
    /// Seconds since the start.
    pub seconds: f64,
    /// I/Os per second over the interval.
    pub iops: f64,
    /// Bytes per second over the interval.
    pub bytes_per_second: f64,
    /// Dirty bytes in the caches at the end of the interval.
    pub dirty_bytes: u64,
    /// Bytes per second the caches wrote back over the interval.
    pub writeback_bytes_per_second: f64,
}

/// Writes `rows` as an SVG chart to `path`, titled `title`.
pub fn write_svg(path: &std::path::Path, title: &str, rows: &[Row]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("--timeline-svg {}: {e}", path.display());
    let end = rows.last().map_or(1.0, |r| r.seconds).max(1e-3);
    let mb = |b: f64| b / 1e6;
    // A burst (a cache absorbing writes at memory speed before the throttle starts) would
    // flatten everything else: the scale stops at four times the median, and the peak is
    // named instead.
    let mut rates: Vec<f64> = rows
        .iter()
        .map(|r| mb(r.bytes_per_second).max(mb(r.writeback_bytes_per_second)))
        .collect();
    let peak = rates.iter().copied().fold(0.0f64, f64::max).max(1e-3);
    rates.sort_by(f64::total_cmp);
    let median = rates.get(rates.len() / 2).copied().unwrap_or(peak);
    let clipped = peak > 4.0 * median && median > 0.0;
    let top = if clipped { 4.0 * median } else { peak * 1.05 };
    let clip = |v: f64| v.min(top);
    let rate_desc = if clipped {
        format!("MB/s (peak {peak:.0}, off the scale)")
    } else {
        "MB/s".to_string()
    };
    let dirty_top = rows
        .iter()
        .map(|r| r.dirty_bytes as f64 / (1 << 20) as f64)
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.05;
    {
        let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let root = root
            .titled(title, ("sans-serif", 20))
            .map_err(|e| err(&e))?;
        let (upper, lower) = root.split_vertically(400);

        let mut c = ChartBuilder::on(&upper)
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..end, 0.0..top)
            .map_err(|e| err(&e))?;
        c.configure_mesh()
            .y_desc(rate_desc)
            .x_desc("seconds")
            .draw()
            .map_err(|e| err(&e))?;
        c.draw_series(LineSeries::new(
            rows.iter()
                .map(|r| (r.seconds, clip(mb(r.bytes_per_second)))),
            BLUE.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label("written by the job")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
        c.draw_series(LineSeries::new(
            rows.iter()
                .map(|r| (r.seconds, clip(mb(r.writeback_bytes_per_second)))),
            RED.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label("written back by the caches")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
        c.configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;

        let mut d = ChartBuilder::on(&lower)
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..end, 0.0..dirty_top)
            .map_err(|e| err(&e))?;
        d.configure_mesh()
            .y_desc("dirty MiB")
            .x_desc("seconds")
            .draw()
            .map_err(|e| err(&e))?;
        d.draw_series(LineSeries::new(
            rows.iter()
                .map(|r| (r.seconds, r.dirty_bytes as f64 / (1 << 20) as f64)),
            GREEN.stroke_width(2),
        ))
        .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_is_an_svg_with_every_row_plotted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.svg");
        let rows: Vec<Row> = (1..=30)
            .map(|i| Row {
                seconds: f64::from(i),
                iops: 1000.0,
                bytes_per_second: 4.1e6,
                dirty_bytes: (40 + i as u64) << 20,
                writeback_bytes_per_second: 4.0e6,
            })
            .collect();
        write_svg(&path, "a run", &rows).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
        assert!(svg.contains("a run") && svg.contains("dirty MiB"));
        // Three data lines of 30 points each (the legend's samples have 2).
        let lines = svg
            .lines()
            .filter(|l| l.contains("<polyline") && l.contains("stroke-width=\"2\""))
            .filter(|l| {
                let points = l.split("points=\"").nth(1).unwrap();
                points.split('"').next().unwrap().split_whitespace().count() == 30
            })
            .count();
        assert_eq!(lines, 3, "{svg}");
        // An unwritable path is an error, not a panic.
        assert!(write_svg(&dir.path().join("no/such/dir.svg"), "x", &rows).is_err());
        // A burst far above the rest is named, not scaled to.
        let mut burst = rows.clone();
        burst[0].bytes_per_second = 60e6;
        write_svg(&path, "a burst", &burst).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("peak 60, off the scale"), "{svg}");
    }
}
