/**
 * fluksio_nb in JupyterLab and Notebook 7: two status-bar items, the shares
 * and what is used (in Notebook 7, which has no status bar, both in the
 * page's top bar), a sidebar panel one click on either away, and notices
 * when the user's claims start or end, all fed by one poll of the server
 * extension. The notices follow the extension's settings
 * (schema/plugin.json), read through the setting registry, and change as
 * soon as the user changes them.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Panel } from '@lumino/widgets';

import { errorsPlugin } from './errors';
import { MachineModel } from './model';
import { Notices, noticeSettings } from './notices';
import { MachinePanel } from './panel';
import { UseStatus } from './glance';
import { drawSavedViews } from './saved';
import { MachineStatus } from './status';

/** What Notebook 7 calls itself: its pages have a top bar and no status bar. */
const NOTEBOOK_7 = 'Jupyter Notebook';

const OPEN = 'fluksio-nb:open';

const PLUGIN = 'fluksio-nb:plugin';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN,
  description:
    "The machine's shares: a status-bar item, a panel of every kernel's claims, " +
    'and notices when your claims start or end.',
  autoStart: true,
  optional: [IStatusBar, ILayoutRestorer, ICommandPalette, ISettingRegistry],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    settings: ISettingRegistry | null
  ) => {
    // Before any notebook opens: a saved monitor must never say "model not found".
    drawSavedViews(app);
    const model = new MachineModel();
    const openNotebook = (path: string) => {
      void app.commands.execute('docmanager:open', { path });
    };
    const panel = new MachinePanel(model, openNotebook);
    // The notebook the person works in: the notices of its claims' ends can wait.
    const frontPath = () =>
      (app.shell.currentWidget as { context?: { path?: string } } | null)?.context?.path ?? null;
    const notices = new Notices(model, openNotebook, frontPath);
    settings
      ?.load(PLUGIN)
      .then(loaded => {
        const read = () => {
          notices.settings = noticeSettings(loaded.composite as Record<string, unknown>);
        };
        read();
        loaded.changed.connect(read);
      })
      .catch(reason => {
        // The defaults stand; the console says why the user's own were not read.
        console.warn(`fluksio-nb: could not read the settings, using the defaults: ${reason}`);
      });
    app.shell.add(panel, 'left', { rank: 900 });
    restorer?.add(panel, panel.id);

    app.commands.addCommand(OPEN, {
      label: "Show the Machine's Shares",
      execute: () => {
        app.shell.activateById(panel.id);
        void model.refresh();
      }
    });
    palette?.addItem({ command: OPEN, category: 'fluksio' });

    // The kernel of the notebook in front, read as any document with a session
    // says it: the item beside the shares shows that kernel's memory.
    const currentKernel = () => {
      const current = app.shell.currentWidget as {
        sessionContext?: { session?: { kernel?: { id: string } | null } | null };
      } | null;
      return current?.sessionContext?.session?.kernel?.id ?? null;
    };
    const open = () => void app.commands.execute(OPEN);
    const shares = new MachineStatus(model, open);
    const use = new UseStatus(model, open, currentKernel);
    const shell = app.shell as { currentChanged?: { connect: (slot: () => void) => void } };
    shell.currentChanged?.connect(() => use.refresh());
    if (app.name === NOTEBOOK_7 || statusBar === null) {
      // Notebook 7 has no status bar: both items go in the page's top bar,
      // right of the notebook's name, one click from the panel.
      const bar = new Panel();
      bar.id = 'fluksio-nb-topbar';
      bar.addClass('fluksio-lab-topbar');
      bar.addWidget(shares);
      bar.addWidget(use);
      app.shell.add(bar, 'top', { rank: 1000 });
    } else {
      statusBar.registerStatusItem(OPEN, { item: shares, align: 'left', rank: 100 });
      statusBar.registerStatusItem('fluksio-nb:use', { item: use, align: 'left', rank: 101 });
    }
  }
};

export default [plugin, errorsPlugin];
