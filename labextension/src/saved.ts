/**
 * A `%claims` monitor, or a background claim saved while it ran, opened again
 * without the kernel that drew it: the saved text, marked stale, never
 * "Error displaying widget: model not found".
 *
 * Both are saved as an ipywidgets widget view with text and HTML fallbacks.
 * JupyterLab and Notebook 7 pick the widget view, whose model lived only in
 * the kernel that drew it: with a new kernel the view says "model not
 * found", with none it says "Loading widget..." for good. The kernel also
 * says which of ours the display is (fluksio_nb/widget/saved.py); this draws
 * that, ranked before the widget view, in each notebook's own rendermime
 * (where ipywidgets puts its widget-view renderer, bound to that notebook's
 * kernel):
 *
 * - with no kernel, the saved HTML at once, marked stale;
 * - with a kernel, ipywidgets' own renderer for the same model, unchanged:
 *   a live widget draws as it always did, never waiting on anything of
 *   ours. Beside it the kernel is asked which widgets it holds; if it does
 *   not hold this one and the view has drawn nothing, the saved HTML takes
 *   its place, marked stale. That question waits behind a running cell, so
 *   it is only ever asked beside the live renderer, not before it.
 *
 * It is added as the Notebook widget factory's extension, which runs as each
 * notebook panel is made, before its outputs are drawn (the notebook tracker
 * would do as well, but @jupyterlab/notebook is not among this package's
 * dependencies, and nothing else here needs it).
 *
 * The factory is not safe: an untrusted notebook keeps its sanitized
 * text/html, as it does for a widget view. Stale is said in the words of the
 * live monitor's own mark (format.ts, from fluksio_nb/widget/widget.js).
 */
import type { JupyterFrontEnd } from '@jupyterlab/application';
import type { ISessionContext } from '@jupyterlab/apputils';
import type { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import type { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { PanelLayout, Widget } from '@lumino/widgets';

import { STALE_MONITOR, STALE_SAVED } from './format';

/** Which of our widgets a display is: `{"model_id": ..., "kind": "monitor" | "claim"}`. */
export const SAVED_VIEW = 'application/vnd.fluksio-nb.live-view+json';

const WIDGET_VIEW = 'application/vnd.jupyter.widget-view+json';

/** ipywidgets' widget-view renderers are at -10: ours must be picked first. */
const RANK = -20;

/** Where one notebook draws: its rendermime and its session. */
interface Place {
  rendermime: IRenderMimeRegistry;
  sessionContext: ISessionContext;
}

/** Draw our mime type in every notebook opened from now on. */
export function drawSavedViews(app: JupyterFrontEnd): void {
  app.docRegistry.addWidgetExtension('Notebook', {
    createNew: (panel: Widget, context: { sessionContext: ISessionContext }) => {
      const rendermime = (panel as Widget & { content?: { rendermime?: IRenderMimeRegistry } })
        .content?.rendermime;
      if (!rendermime) {
        return;
      }
      const place = { rendermime, sessionContext: context.sessionContext };
      rendermime.addFactory(
        {
          safe: false,
          mimeTypes: [SAVED_VIEW],
          createRenderer: () => new SavedView(place)
        },
        RANK
      );
    }
  });
}

export class SavedView extends Widget implements IRenderMime.IRenderer {
  constructor(place: Place) {
    super();
    this._place = place;
    this.addClass('fluksio-lab-saved-view');
    this.layout = new PanelLayout();
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const view = (model.data[SAVED_VIEW] ?? {}) as { model_id?: unknown; kind?: unknown };
    const modelId = typeof view.model_id === 'string' ? view.model_id : '';
    const session = this._place.sessionContext;
    try {
      // Until the notebook knows whether it has a kernel: a page reloaded
      // beside a running kernel must not take its live widgets for dead.
      await session.ready;
    } catch {
      // A session that failed to start has no kernel: said below.
    }
    // ipywidgets binds its renderer to this notebook's kernel in promises that
    // follow the same readiness; a task later they have all run.
    await new Promise(resolve => setTimeout(resolve, 0));
    if (this.isDisposed) {
      return;
    }
    const kernel = session.session?.kernel ?? null;
    if (kernel === null || !modelId || !this._place.rendermime.getFactory(WIDGET_VIEW)) {
      this._showSaved(model, view.kind);
      return;
    }
    const live = this._place.rendermime.createRenderer(WIDGET_VIEW);
    (this.layout as PanelLayout).addWidget(live);
    const drawn = live.renderModel(model);
    void kernel
      .requestCommInfo({ target_name: 'jupyter.widget' })
      .then(reply => {
        const content = reply.content;
        // Own keys only: a model id is the notebook file's to say, "__proto__" included.
        const held =
          content.status === 'ok' &&
          Object.prototype.hasOwnProperty.call(content.comms ?? {}, modelId);
        // ipywidgets' renderer is a panel that holds the widget's view once drawn;
        // one drawn is shown, whatever the kernel says of it now.
        const views = (live as Widget & { widgets?: readonly Widget[] }).widgets ?? [];
        const drewNothing = views.length === 0;
        if (!held && drewNothing && !this.isDisposed && !live.isDisposed) {
          live.dispose();
          this._showSaved(model, view.kind);
        }
      })
      .catch(() => {
        // A kernel gone while asked: its monitor marks itself stale.
      });
    await drawn;
  }

  /** The saved HTML, marked stale, as this notebook draws any trusted HTML. */
  private _showSaved(model: IRenderMime.IMimeModel, kind: unknown): void {
    this.node.dataset.stale = 'yes';
    const mark = new Widget();
    mark.addClass('fluksio-lab-saved-stale');
    mark.node.textContent = kind === 'monitor' ? `${STALE_SAVED} ${STALE_MONITOR}` : STALE_SAVED;
    (this.layout as PanelLayout).addWidget(mark);
    const html = model.data['text/html'];
    const text = model.data['text/plain'];
    const mimeType = html !== undefined ? 'text/html' : 'text/plain';
    const saved = this._place.rendermime.createRenderer(mimeType);
    (this.layout as PanelLayout).addWidget(saved);
    void saved.renderModel({
      trusted: model.trusted,
      data: { [mimeType]: html ?? text ?? '' },
      metadata: {},
      setData: () => undefined
    });
  }

  private _place: Place;
}
