"""Ready-made recipes: VGG19 on CIFAR-100 and BERT masked-language-model pre-training.

Installed as ``lightning_pipe.recipes``; each recipe is an ordinary LightningModule whose layers
form one ``nn.Sequential``, plus a LightningDataModule that works offline by default.
"""
